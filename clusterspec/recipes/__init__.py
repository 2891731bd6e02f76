"""The documented gpt-oss deployments on Neuron, each one a typed recipe from its reference.

A recipe is the serving configuration its reference tested (flags, environment with the
reasons, ports, start order, benchmark shape) plus the names and fleet defaults of its stack.
`-c recipe=NAME` picks one; every value stays overridable under `serving.*`, and a recipe
refuses what its reference forbids.
"""

from __future__ import annotations

from clusterspec.recipes.base import Recipe


def _registry() -> dict[str, Recipe]:
    from clusterspec.recipes import gptoss_8k1k, gptoss_di, gptoss_single

    recipes = [gptoss_8k1k.RECIPE, gptoss_single.GPTOSS_120B, gptoss_single.GPTOSS_20B, gptoss_di.GPTOSS_120B, gptoss_di.GPTOSS_20B]
    return {r.name: r for r in recipes}


RECIPES: dict[str, Recipe] = _registry()
DEFAULT_RECIPE = "gptoss-120b-8k1k"
