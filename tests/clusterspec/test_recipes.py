"""Every recipe against its reference: flags and environment typed out from the reference text.

Reference 001 (Neuron gpt-oss tutorial): the single-instance server and the DI decode and
prefill servers, for 120B and 20B. The expected values below are copied from that text, not
read from the recipes under test. Where the project adds to a reference command, the test
says so (vLLM's default made explicit, or a value the layout decides).
"""

from __future__ import annotations

from typing import Any

import pytest

from clusterspec.errors import SpecError
from clusterspec.loading import load_config
from clusterspec.recipes import RECIPES
from node_render import limits
from tests.conftest import argv_flags, rendered_services

HF_OVERRIDES = {"quantization_config": {}}


def services(recipe: str, **context: str) -> dict[str, dict[str, Any]]:
    return rendered_services(recipe=recipe, **context)


flags = argv_flags


def without_project_env(env: dict[str, str]) -> dict[str, str]:
    """The server's environment without the wrapper's own GPTOSS_* helpers (port, config for the Exec line)."""
    return {k: v for k, v in env.items() if not k.startswith("GPTOSS_")}


# ---- single instance (001, "Deploy on a single instance (non-DI)") ------------------------------

# "Set environment variables": compilation and execution timeouts for gpt-oss.
SINGLE_ENV = {"VLLM_NEURON_COMPILATION_TIMEOUT": "1200", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1200"}
SINGLE_FLAGS = {
    "--tensor-parallel-size": "8",
    "--enable-prefix-caching": None,
    "--no-disable-hybrid-kv-cache-manager": None,
    "--max-model-len": "16384",
    "--max-num-batched-tokens": "8192",
    "--max-num-seqs": "4",
    "--hf-overrides": HF_OVERRIDES,
    "--additional-config": {"neuron_config": {"num_batched_tokens_buckets": [8192], "num_seqs_buckets": [4]}},
}


@pytest.mark.parametrize(("recipe", "model"), [("gptoss-120b-single", "gpt-oss-120b"), ("gptoss-20b-single", "gpt-oss-20b")])
def test_single_instance_server_is_the_references_command(recipe: str, model: str) -> None:
    s = services(recipe)
    assert {k.split(":")[0] for k in s} == {"gptoss-server.service", "gptoss-bench.service"}
    server = s["gptoss-server.service"]
    assert server["node"] == "server-0"
    assert server["argv"][:3] == ["vllm", "serve", f"/opt/dlami/nvme/models/{model}"]
    # --port 8000: vLLM's default ("The server listens on port 8000"), made explicit.
    assert flags(server["argv"]) == SINGLE_FLAGS | {"--port": "8000"}
    assert without_project_env(server["env"]) == SINGLE_ENV


def test_single_instance_runs_on_trn2_with_the_backends_bf16() -> None:
    """'the same command works on Trn3 (MXFP4) or Trn2 (BF16)': no quantization flag to change."""
    trn2 = services("gptoss-20b-single", instance_type="trn2.48xlarge")["gptoss-server.service"]
    assert flags(trn2["argv"]) == SINGLE_FLAGS | {"--port": "8000"}


# ---- disaggregated inference (001, "Deploy with disaggregated inference") -----------------------

# Step 1, on both instances.
DI_BOTH = {
    "VLLM_NEURON_COMPILATION_TIMEOUT": "2400",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1200",
    "VLLM_ENGINE_READY_TIMEOUT_S": "5400",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0",
}
KV = {"kv_connector": "NixlConnector", "kv_buffer_device": "cuda", "kv_connector_extra_config": {"backends": ["LIBFABRIC"]}}
# Step 2 (decode, 120B) and its 20B note: "--data-parallel-size 4, embedding_dp_size: 4,
# lm_head_dp_size: 4, and omit --optimization-level 2".
DECODE_120B = {
    "--tensor-parallel-size": "8",
    "--data-parallel-size": "8",
    "--enable-expert-parallel": None,
    "--optimization-level": "2",
    "--dtype": "bfloat16",
    "--max-model-len": "16384",
    "--max-num-batched-tokens": "8192",
    "--max-num-seqs": "4",
    "--max-logprobs": "0",
    "--no-disable-hybrid-kv-cache-manager": None,
    "--port": "8200",
    "--hf-overrides": HF_OVERRIDES,
    "--kv-transfer-config": KV | {"kv_role": "kv_consumer"},
    "--additional-config": {
        "neuron_config": {
            "quantization": "mxfp4",
            "embedding_dp_size": 8,
            "lm_head_dp_size": 8,
            "kv_segment_size_buckets": [8192],
            "num_batched_tokens_buckets": [8192],
            "num_seqs_buckets": [4],
        }
    },
}
DECODE_20B = {k: v for k, v in DECODE_120B.items() if k != "--optimization-level"} | {
    "--data-parallel-size": "4",
    "--additional-config": {
        "neuron_config": DECODE_120B["--additional-config"]["neuron_config"] | {"embedding_dp_size": 4, "lm_head_dp_size": 4}  # type: ignore[index]
    },
}
# Step 3 (prefill): the same for both models.
PREFILL = {
    "--tensor-parallel-size": "4",
    "--data-parallel-size": "1",
    "--enable-expert-parallel": None,
    "--dtype": "bfloat16",
    "--max-model-len": "16384",
    "--max-num-batched-tokens": "8192",
    "--max-num-seqs": "1",
    "--no-disable-hybrid-kv-cache-manager": None,
    "--port": "8100",
    "--hf-overrides": HF_OVERRIDES,
    "--kv-transfer-config": KV | {"kv_role": "kv_producer"},
    "--additional-config": {
        "neuron_config": {
            "quantization": "mxfp4",
            "ep_degree": 2,
            "kv_segment_size_buckets": [8192],
            "num_batched_tokens_buckets": [8192],
            "num_seqs_buckets": [1],
        }
    },
}


@pytest.mark.parametrize(("recipe", "model", "decode"), [("gptoss-120b-di", "gpt-oss-120b", DECODE_120B), ("gptoss-20b-di", "gpt-oss-20b", DECODE_20B)])
def test_di_decode_and_prefill_are_the_references_commands(recipe: str, model: str, decode: dict[str, Any]) -> None:
    s = services(recipe)
    d = s["gptoss-decode.service"]
    assert d["node"] == "decode-0" and d["argv"][:3] == ["vllm", "serve", f"/opt/dlami/nvme/models/{model}"]
    assert flags(d["argv"]) == decode
    # Step 2: "bind all 64 cores and set the decode-side NIXL side channel port".
    assert without_project_env(d["env"]) == DI_BOTH | {"NEURON_VISIBLE_DEVICES": "0-63", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5659"}
    p = s["gptoss-prefill@0.service"]
    assert p["node"] == "prefill-0" and flags(p["argv"]) == PREFILL
    # Step 3: "bind four cores and set the prefill-side NIXL side channel port".
    assert without_project_env(p["env"]) == DI_BOTH | {"NEURON_VISIBLE_DEVICES": "0-3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5559"}
    # Step 4: the proxy on the prefill instance, one prefill host per port, the decode host.
    assert s["gptoss-proxy.service"]["argv"][1:] == [
        "/opt/gptoss/vllm-neuron/examples/vllm_neuron/vllm/disaggregated_inference/toy_proxy_server.py",
        "--host", "0.0.0.0", "--port", "8000",
        "--prefiller-hosts", "<prefill-0>", "--prefiller-ports", "8100",
        "--decoder-hosts", "<decode-0>", "--decoder-ports", "8200",
    ]  # fmt: skip
    assert s["gptoss-proxy.service"]["node"] == "prefill-0"


def test_sixteen_prefill_servers_tile_one_instance_one_side_channel_apart() -> None:
    """'Scale prefill to fully utilize the instance': 16 TP4 servers, cores 4i..4i+3, ports 8100+i, side channel 5559+i."""
    s = services("gptoss-120b-di", prefill_per_decode="16")
    for i in range(16):
        p = s[f"gptoss-prefill@{i}.service"]
        assert p["node"] == "prefill-0"
        env = without_project_env(p["env"])
        assert (env["NEURON_VISIBLE_DEVICES"], env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == (f"{4 * i}-{4 * i + 3}", str(5559 + i))
        assert flags(p["argv"])["--port"] == str(8100 + i)
    argv = s["gptoss-proxy.service"]["argv"]
    assert argv[argv.index("--prefiller-hosts") + 1 : argv.index("--prefiller-ports")] == ["<prefill-0>"] * 16
    cfg = load_config({"recipe": "gptoss-120b-di", "prefill_per_decode": "16"})
    assert [(n.name, len(n.replicas), n.idle_cores) for n in cfg.layout.nodes] == [("prefill-0", 16, 0), ("decode-0", 0, 0)]


def test_di_recipes_size_fleets_from_their_ratio() -> None:
    cfg = load_config({"recipe": "gptoss-20b-di", "prefill_per_decode": "16", "decode_instances": "4"})
    assert [(n.role, len(n.replicas)) for n in cfg.layout.nodes] == [("prefill", 16)] * 4 + [("decode", 0)] * 4
    assert [p.node for p in cfg.layout.proxies] == [f"decode-{i}" for i in range(4)]


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        ({"recipe": "gptoss-120b-di", "serving.decode.data_parallel": "4", "serving.decode.ep_degree": "32",
          "serving.decode.embedding_dp_size": "4", "serving.decode.lm_head_dp_size": "4"},
         "serving.decode.data_parallel=4: gives EP32; the gptoss-120b-di recipe is tested at EP64 and its reference warns that "
         "untested EP degrees have produced degenerate output. Fix: keep data_parallel=8 (EP64)."),
        ({"recipe": "gptoss-120b-di", "serving.decode.embedding_dp_size": "1"},
         "serving.decode.embedding_dp_size=1: is replicated over the data-parallel ranks in this recipe: it must equal data_parallel=8."),
        ({"recipe": "gptoss-20b-single", "decode_instances": "2"}, "decode_instances=2: the gptoss-20b-single recipe runs one server on one instance."),
        ({"recipe": "gptoss-20b-di", "instance_type": "trn2.48xlarge"}, "instance_type='trn2.48xlarge': the MXFP4 path"),
        ({"recipe": "gptoss-20b-di", "serving.recipe": "gptoss-120b-8k1k"}, "serving.recipe='gptoss-120b-8k1k': is set by the recipe (gptoss-20b-di)"),
        ({"recipe": "gptoss-70b"}, "recipe='gptoss-70b': is not a recipe. Fix: use one of gptoss-120b-8k1k, gptoss-120b-single"),
    ],
)  # fmt: skip
def test_a_recipe_refuses_what_its_reference_forbids(context: dict[str, str], expected: str) -> None:
    with pytest.raises(SpecError) as err:
        limits.check(load_config(context))
    assert expected in str(err.value)


def test_trn2_di_is_bf16_by_an_explicit_choice() -> None:
    """The reference gives no Trn2 DI flags: BF16 is assumed, asked for explicitly, and drops only the quantization key."""
    s = services("gptoss-120b-di", instance_type="trn2.48xlarge", **{"serving.shape.quantization": "bf16"})
    d = flags(s["gptoss-decode.service"]["argv"])
    assert "quantization" not in d["--additional-config"]["neuron_config"] and d["--dtype"] == "bfloat16"


def test_each_recipe_names_its_stack_cluster_and_results() -> None:
    expected = {
        "gptoss-120b-8k1k": ("GptOss8k1kStack", "gptoss-8k1k", 15),
        "gptoss-120b-single": ("GptOss120bSingleStack", "gptoss-120b-single", 15),
        "gptoss-20b-single": ("GptOss20bSingleStack", "gptoss-20b-single", 3),
        "gptoss-120b-di": ("GptOss120bDiStack", "gptoss-120b-di", 15),
        "gptoss-20b-di": ("GptOss20bDiStack", "gptoss-20b-di", 3),
    }
    assert set(RECIPES) == set(expected)
    for name, (stack, cluster, shards) in expected.items():
        cfg = load_config({"recipe": name})
        assert (cfg.stack_name, cfg.cluster_name, cfg.model.expected_shards) == (stack, cluster, shards)
        assert cfg.results_dir == f"/root/{cfg.serving.model_id.split('/')[1]}-{name.rsplit('-', 1)[1]}-results"
    # The user's own names win over the recipe's.
    assert load_config({"recipe": "gptoss-20b-di", "cluster_name": "team-a"}).cluster_name == "team-a"


def test_the_default_recipe_is_reference_000() -> None:
    assert load_config({}).model_dump() == load_config({"recipe": "gptoss-120b-8k1k"}).model_dump()
    assert load_config({}).serving == RECIPES["gptoss-120b-8k1k"].serving
