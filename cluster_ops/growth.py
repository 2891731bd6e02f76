"""Whether a fleet is bigger than its operator can be expected to mean: plan says so, deploy asks."""

from __future__ import annotations

from cluster_ops import common
from clusterspec.config import ClusterConfig
from clusterspec.errors import SpecError
from clusterspec.loading import load_config

# A deploy asks before it bills this many times the fleet the user can be expected to have in mind.
GROWTH_FACTOR = 4
GROWTH_MIN_NODES = 8


def fleet_growth(cfg: ClusterConfig) -> str | None:
    """Why this fleet may be bigger than meant, or None: at least GROWTH_FACTOR times (and
    GROWTH_MIN_NODES instances) the fleet last deployed under this stack name from this checkout,
    or, on a first deploy, the recipe's own fleet for the same decode_instances and instance type
    (so prefill_per_decode=1000 or a replicas_per_prefill_instance of 1 is caught, the 3 + 8
    layout asked with decode_instances=8 is not)."""
    nodes = len(cfg.layout.nodes)
    if nodes < GROWTH_MIN_NODES:
        return None
    record = common.deployed().get(cfg.stack_name)
    try:
        if record is not None:
            before = len(load_config(common.context(list(record["context"]))).layout.nodes)
            than = f"the {before} instance{'s' * (before != 1)} last deployed as {cfg.stack_name} from this checkout"
        else:
            base = load_config({"recipe": cfg.recipe, "decode_instances": cfg.decode_instances, "instance_type": cfg.instance_type})
            before = len(base.layout.nodes)
            than = (f"the {cfg.recipe} recipe's {before} for decode_instances={cfg.decode_instances} "
                    f"(prefill_per_decode={cfg.prefill_per_decode}, replicas_per_prefill_instance={cfg.replicas_per_prefill_instance or 'fill'})")  # fmt: skip
    except (SpecError, ValueError, KeyError, TypeError):
        return None  # no baseline to compare with: nothing to say
    if nodes < GROWTH_FACTOR * before:
        return None
    return f"{nodes} x {cfg.instance_type} is {nodes / before:.0f}x {than}"
