"""gptoss-120b-single and gptoss-20b-single: reference 001, 'Deploy on a single instance (non-DI)'.

One `vllm serve` with TP8 on one instance, on port 8000, prefix caching on, context 16,384.
No proxy, no NIXL, no EFA between nodes. The backend picks MXFP4 on Trn3 and BF16 on Trn2 by
itself, so the same recipe runs on both.
"""

from __future__ import annotations

from clusterspec.recipes.base import Recipe
from clusterspec.sections.flags import EnvSetting

# 001, single instance: "Compilation and execution timeouts for gpt-oss."
from clusterspec.sections.servers import Server, Shape
from clusterspec.sections.serving import Bench, Serving

SINGLE_ENV = {
    "VLLM_NEURON_COMPILATION_TIMEOUT": EnvSetting(value="1200", reason="gpt-oss compilation runs longer than the vLLM default."),
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": EnvSetting(value="1200", reason="gpt-oss execution runs longer than the vLLM default."),
}

SHAPE = Shape(
    max_model_len=16384,
    max_num_batched_tokens=8192,
    output_len=1024,
    block_size=None,
    kv_cache_dtype=None,
    fp8_packed_kv=False,
    kv_segment_buckets=False,
    dtype=None,
    distributed_executor_backend=None,
    quantization=None,
)


def _serving(name: str, model: str) -> Serving:
    server = Server(tensor_parallel=8, lnc=2, max_num_seqs=4, port=8000, enable_prefix_caching=True)
    return Serving(
        recipe=name,
        topology="single",
        explicit_lnc=False,
        model_id=model,
        shape=SHAPE,
        server=server,
        common_env=dict(SINGLE_ENV),
        # The reference gives no benchmark shape: 000's (8K in, 1K out), 10x and 100x the server's batch.
        bench=Bench(warmup_prompts=10 * server.capacity, measured_prompts=100 * server.capacity),
    )


GPTOSS_120B = Recipe(
    name="gptoss-120b-single",
    reference="001: Neuron gpt-oss tutorial (SDK 2.31), single instance, gpt-oss-120b",
    deploys="1 TP8 server on port 8000 on 1 instance (no proxy, no EFA traffic)",
    stack_name="GptOss120bSingleStack",
    cluster_name="gptoss-120b-single",
    results_dir="/root/gpt-oss-120b-single-results",
    prefill_per_decode=1,
    expected_shards=15,
    serving=_serving("gptoss-120b-single", "openai/gpt-oss-120b"),
)
GPTOSS_20B = Recipe(
    name="gptoss-20b-single",
    reference="001: Neuron gpt-oss tutorial (SDK 2.31), single instance, gpt-oss-20b",
    deploys="1 TP8 server on port 8000 on 1 instance (no proxy, no EFA traffic)",
    stack_name="GptOss20bSingleStack",
    cluster_name="gptoss-20b-single",
    results_dir="/root/gpt-oss-20b-single-results",
    prefill_per_decode=1,
    expected_shards=3,
    serving=_serving("gptoss-20b-single", "openai/gpt-oss-20b"),
)
