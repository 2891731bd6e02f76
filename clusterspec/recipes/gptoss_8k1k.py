"""gptoss-120b-8k1k: reference 000, the tested 8K/1K configuration (6P1D on two Trn3 instances).

Its tables are the defaults of clusterspec/sections/ (servers.py, flags.py), where each value carries its reason.
"""

from __future__ import annotations

from clusterspec.recipes.base import Recipe
from clusterspec.sections.serving import Serving

RECIPE = Recipe(
    name="gptoss-120b-8k1k",
    reference="000: Neuron SDK 2.33, GPT-OSS 120B 8K/1K on Trn3",
    deploys="6 TP4 prefill replicas + 1 TP8 DP16 EP128 megakernel decode server (LNC=1) on 2 instances; "
    "prefill_per_decode=6 per decode server, 16 replicas per prefill instance (3 + 8 for production)",
    stack_name="GptOss8k1kStack",
    cluster_name="gptoss-8k1k",
    results_dir="/root/gpt-oss-120b-8k1k-results",
    prefill_per_decode=6,
    expected_shards=15,
    serving=Serving(),
)
