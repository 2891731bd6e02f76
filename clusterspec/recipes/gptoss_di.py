"""gptoss-120b-di and gptoss-20b-di: reference 001, 'Deploy with disaggregated inference'.

1P1D by default (one TP4 prefill replica, one decode server); -c prefill_per_decode=16 gives
the reference's 16P1D (16 replicas tile one prefill instance). Decode TP8 DP8 EP64 for 120B
(--optimization-level 2), TP8 DP4 EP32 for 20B; embedding and lm_head replicated over DP.
Side channels: decode 5659, prefill replicas 5559, 5560, ... (one apart). On Trn2 the
reference gives no DI flags: BF16 is assumed (set serving.shape.quantization=bf16), untested.
"""

from __future__ import annotations

from clusterspec.recipes.base import Recipe
from clusterspec.sections.flags import EnvSetting
from clusterspec.sections.servers import Decode, Prefill, Shape
from clusterspec.sections.serving import Bench, Serving


def _env(**pairs: tuple[str, str]) -> dict[str, EnvSetting]:
    return {k: EnvSetting(value=v, reason=r) for k, (v, r) in pairs.items()}


# 001, DI step 1: "Set these on both the prefill and decode instances before launching."
DI_ENV = _env(
    VLLM_NEURON_COMPILATION_TIMEOUT=("2400", "gpt-oss compilation runs longer than the vLLM default."),
    VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=("1200", "Multi-node startup runs longer than the vLLM default."),
    VLLM_ENGINE_READY_TIMEOUT_S=("5400", "The startup of one server; the first launch compiles the graphs."),
    VLLM_NIXL_SIDE_CHANNEL_HOST=("0.0.0.0", "Listen on all interfaces so the peer can reach it over EFA."),
)

SHAPE = Shape(
    max_model_len=16384,
    max_num_batched_tokens=8192,
    output_len=1024,
    block_size=None,
    kv_cache_dtype=None,
    fp8_packed_kv=False,
    kv_segment_buckets=True,
    dtype="bfloat16",
    distributed_executor_backend=None,
    quantization="mxfp4",
)
PREFILL = Prefill(
    tensor_parallel=4,
    ep_degree=2,
    lnc=2,
    max_num_seqs=1,
    http_port_base=8100,
    side_channel_port_base=5559,
    side_channel_port_step=1,
    side_channel_in_config=False,
    max_logprobs=None,
)


def _decode(dp: int, optimization_level: int | None) -> Decode:
    return Decode(
        tensor_parallel=8,
        data_parallel=dp,
        ep_degree=8 * dp,
        lnc=2,
        max_num_seqs=4,
        optimization_level=optimization_level,
        embedding_dp_size=dp,
        lm_head_dp_size=dp,
        tail_hops=(),
        http_port=8200,
        side_channel_port=5659,
        env={},
        schedule_file=None,
        ep_in_neuron_config=False,
        visible_all_cores=True,
        max_logprobs=0,
    )


def _serving(name: str, model: str, dp: int, optimization_level: int | None) -> Serving:
    capacity = 4 * dp
    return Serving(
        recipe=name,
        topology="disaggregated",
        explicit_lnc=False,
        tested_decode_ep=8 * dp,
        model_id=model,
        shape=SHAPE,
        decode=_decode(dp, optimization_level),
        prefill=PREFILL,
        common_env=dict(DI_ENV),
        # The reference gives no benchmark shape: 000's (8K in, 1K out), 10x and 100x the decode capacity.
        bench=Bench(warmup_prompts=10 * capacity, measured_prompts=100 * capacity),
    )


GPTOSS_120B = Recipe(
    name="gptoss-120b-di",
    reference="001: Neuron gpt-oss tutorial (SDK 2.31), disaggregated inference, gpt-oss-120b",
    deploys="1 TP4 prefill replica + 1 TP8 DP8 EP64 decode server (1P1D) on 2 instances; prefill_per_decode=16 for 16P1D",
    stack_name="GptOss120bDiStack",
    cluster_name="gptoss-120b-di",
    results_dir="/root/gpt-oss-120b-di-results",
    prefill_per_decode=1,
    expected_shards=15,
    serving=_serving("gptoss-120b-di", "openai/gpt-oss-120b", 8, 2),
)
GPTOSS_20B = Recipe(
    name="gptoss-20b-di",
    reference="001: Neuron gpt-oss tutorial (SDK 2.31), disaggregated inference, gpt-oss-20b",
    deploys="1 TP4 prefill replica + 1 TP8 DP4 EP32 decode server (1P1D) on 2 instances; prefill_per_decode=16 for 16P1D",
    stack_name="GptOss20bDiStack",
    cluster_name="gptoss-20b-di",
    results_dir="/root/gpt-oss-20b-di-results",
    prefill_per_decode=1,
    expected_shards=3,
    serving=_serving("gptoss-20b-di", "openai/gpt-oss-20b", 4, None),
)
