"""What a recipe is: one documented deployment, its reference, and the defaults it sets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clusterspec.sections.serving import Serving


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
