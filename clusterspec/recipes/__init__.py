"""The documented gpt-oss deployments on Neuron, each one a typed recipe from its reference.

A recipe is the serving configuration its reference tested (flags, environment with the
reasons, ports, start order, benchmark shape) plus the names and fleet defaults of its stack.
`-c recipe=NAME` picks one; every value stays overridable under `serving.*`, and a recipe
refuses what its reference forbids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clusterspec.serving import Serving


@dataclass(frozen=True)
class Recipe:
    """One documented deployment: its reference, what it deploys, and its defaults."""

    name: str
    reference: str
    deploys: str
    stack_name: str
    cluster_name: str
    results_dir: str
    prefill_per_decode: int
    expected_shards: int
    serving: Serving

    def defaults(self) -> dict[str, Any]:
        """The parameters this recipe sets before the user's own (which win)."""
        return {
            "stack_name": self.stack_name,
            "cluster_name": self.cluster_name,
            "results_dir": self.results_dir,
            "prefill_per_decode": self.prefill_per_decode,
            "model": {"expected_shards": self.expected_shards},
            "serving": self.serving.model_dump(mode="json"),
        }


def _registry() -> dict[str, Recipe]:
    from clusterspec.recipes import gptoss_8k1k, gptoss_di, gptoss_single

    recipes = [gptoss_8k1k.RECIPE, gptoss_single.GPTOSS_120B, gptoss_single.GPTOSS_20B, gptoss_di.GPTOSS_120B, gptoss_di.GPTOSS_20B]
    return {r.name: r for r in recipes}


RECIPES: dict[str, Recipe] = _registry()
DEFAULT_RECIPE = "gptoss-120b-8k1k"
