"""Every environment variable and flag of the servers against the tables of reference 000.

The expected values are typed out from the reference, not read from the spec under test.
"""

from __future__ import annotations

from typing import Any

from tests.conftest import argv_flags, rendered_services

# Reference 000, "Environment": both roles (env_common.sh).
BOTH_ROLES = {
    "VLLM_NEURON_BACKEND": "neuron_native",
    "NEURON_LIBTORCH_DISABLE_GRAPH_CAPTURE_BACKEND": "1",
    "TORCH_NEURONX_VOCAB_SHARDING_SPMD_DISABLE": "1",
    "NEURON_RT_DBG_VECTOR_DGE_SKIP_NOTIF": "1",
    "VLLM_NEURON_NIXL_PROGRESS_THREAD_DELAY_US": "250",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0",
    "NEURON_LIBTORCH_COMPILATION_TIMEOUT": "2400",
    "VLLM_ENGINE_READY_TIMEOUT_S": "14400",
}
# "Decode only" (run_decode.sh); the schedule path is ours, fixed on NVMe.
DECODE_ONLY = {
    "NEURON_LOGICAL_NC_CONFIG": "1",
    "VLLM_NEURON_MEGA_COLLECTIVE_PRIVATE_SRC": "1",
    "VLLM_NEURON_BATCH_QUEUE_DEPTH": "4",
    "NEURON_RT_XU_WORKER_ENABLE_LOW_LATENCY_COMPLETION": "0",
    "VLLM_NEURON_MEGA_DMA_ORDER_CONSTRAINTS_FILE": "/opt/dlami/nvme/cache/megakernel_schedule/active_dma_order.json",
    "VLLM_NEURON_MEGA_FUSE_EMBED": "1",
    "VLLM_NEURON_TAIL_FLAT_ROW_GATHER": "1",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "8759",
}
MODEL = "/opt/dlami/nvme/models/gpt-oss-120b"
SHAPE_FLAGS = [
    "--max-model-len", "10240",
    "--max-num-batched-tokens", "8192",
]  # fmt: skip
KV = {"kv_connector": "NixlConnector", "kv_buffer_device": "cuda", "kv_connector_extra_config": {"backends": ["LIBFABRIC"]}}


def _services() -> dict[str, dict[str, Any]]:
    return rendered_services()


_flags = argv_flags


def test_decode_environment_is_exactly_both_roles_plus_decode_only() -> None:
    decode = _services()["gptoss-decode.service"]
    assert decode["node"] == "decode-0"
    assert decode["env"] == BOTH_ROLES | DECODE_ONLY


def test_decode_flags_are_the_tested_ones() -> None:
    argv = _services()["gptoss-decode.service"]["argv"]
    assert argv[:3] == ["vllm", "serve", MODEL]
    assert _flags(argv) == {  # type: ignore[arg-type]
        "--tensor-parallel-size": "8",
        "--data-parallel-size": "16",
        "--enable-expert-parallel": None,
        "--optimization-level": "2",
        "--max-model-len": "10240",
        "--max-num-batched-tokens": "8192",
        "--max-num-seqs": "8",
        "--block-size": "128",
        "--kv-cache-dtype": "fp8",
        "--max-logprobs": "0",
        "--no-disable-hybrid-kv-cache-manager": None,
        "--distributed-executor-backend": "mp",
        "--port": "8200",
        "--hf-overrides": {"quantization_config": {}},
        "--kv-transfer-config": KV | {"kv_role": "kv_consumer"},
        "--additional-config": {
            "neuron_config": {
                "quantization": "mxfp4",
                "ep_degree": 128,
                "embedding_dp_size": 1,
                "lm_head_dp_size": 16,
                "gpt_oss_tail_hops": [128],
                "fp8_packed_kv": True,
                "kv_segment_size_buckets": [8192],
                "num_batched_tokens_buckets": [8192],
                "num_seqs_buckets": [8],
            }
        },
    }


def test_each_prefill_replica_gets_its_cores_ports_and_producer_role() -> None:
    services = _services()
    for i in range(6):
        s = services[f"gptoss-prefill@{i}.service"]
        assert s["node"] == "prefill-0"
        env = dict(s["env"])  # type: ignore[call-overload]
        helpers = {k: env.pop(k) for k in list(env) if k.startswith("GPTOSS_")}
        assert env == BOTH_ROLES | {
            "NEURON_LOGICAL_NC_CONFIG": "2",
            "NEURON_VISIBLE_DEVICES": f"{4 * i}-{4 * i + 3}",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(5559 + 100 * i),
        }
        assert set(helpers) == {"GPTOSS_HTTP_PORT", "GPTOSS_ADDITIONAL_CONFIG"}
        assert _flags(s["argv"]) == {  # type: ignore[arg-type]
            "--tensor-parallel-size": "4",
            "--data-parallel-size": "1",
            "--enable-expert-parallel": None,
            "--max-model-len": "10240",
            "--max-num-batched-tokens": "8192",
            "--max-num-seqs": "1",
            "--block-size": "128",
            "--kv-cache-dtype": "fp8",
            "--max-logprobs": "0",
            "--no-disable-hybrid-kv-cache-manager": None,
            "--distributed-executor-backend": "mp",
            "--port": str(8100 + i),
            "--hf-overrides": {"quantization_config": {}},
            "--kv-transfer-config": KV | {"kv_role": "kv_producer"},
            "--additional-config": {
                "neuron_config": {
                    "quantization": "mxfp4",
                    "ep_degree": 2,
                    "fp8_packed_kv": True,
                    "kv_segment_size_buckets": [8192],
                    "num_batched_tokens_buckets": [8192],
                    "num_seqs_buckets": [1],
                },
                "nixl_side_channel_port": 5559 + 100 * i,
            },
        }


def test_proxy_gets_one_prefill_host_per_port_and_the_decode_host() -> None:
    s = _services()["gptoss-proxy.service"]
    assert s["node"] == "prefill-0"
    assert s["argv"] == [
        "python3", "/opt/gptoss/vllm-neuron/examples/vllm_neuron/vllm/disaggregated_inference/toy_proxy_server.py",
        "--host", "0.0.0.0", "--port", "8000",
        "--prefiller-hosts", *["<prefill-0>"] * 6,
        "--prefiller-ports", "8100", "8101", "8102", "8103", "8104", "8105",
        "--decoder-hosts", "<decode-0>",
        "--decoder-ports", "8200",
    ]  # fmt: skip


def test_benchmark_legs_match_step_5() -> None:
    services = _services()
    for step, prompts, result in (("warmup", "1280", "bench_warmup.json"), ("measured", "12800", "bench_clean.json")):
        s = services[f"gptoss-bench.service:{step}"]
        assert s["env"] == {"NETRC": "/dev/null"}
        flags = _flags(s["argv"])
        assert s["argv"][:3] == ["vllm", "bench", "serve"]
        assert flags["--num-prompts"] == prompts
        assert flags["--result-filename"] == result
        assert (flags["--random-input-len"], flags["--random-output-len"], flags["--max-concurrency"]) == ("8192", "1024", "128")
        assert "--ignore-eos" in flags and flags["--base-url"] == "http://127.0.0.1:8000"
