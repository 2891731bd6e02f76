"""A node's rendering as a value (its services, files, units and scripts) and the helpers every
renderer of a unit uses: the templates of userdata/units, systemd quoting, the bounds of a start."""

from __future__ import annotations

from dataclasses import dataclass, field

import jinja2

from clusterspec.config import ClusterConfig
from clusterspec.layout import Node
from clusterspec.sections.boot import BACKOFF_MAX_S, RESTART_SEC
from node_render.paths import USERDATA_DIR
from node_render.quoting import systemd_quote

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(USERDATA_DIR / "units"),
    undefined=jinja2.StrictUndefined,
    # The templates are part of the package: loaded once per process, not checked on disk per unit.
    auto_reload=False,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    # Shell text such as ${#ARR[@]} must never open a Jinja comment.
    comment_start_string="{##",
    comment_end_string="##}",
)

@dataclass(frozen=True)
class Service:
    """One command a unit runs: what `plan` prints for it (the server, after its waits)."""

    unit: str
    environment: dict[str, str]
    argv: list[str]
    step: str | None = None
    waits: tuple[str, ...] = ()

    def as_json(self) -> dict[str, object]:
        """The `plan --json` form of this service."""
        out: dict[str, object] = {"unit": self.unit, "environment": self.environment, "argv": self.argv}
        if self.step:
            out["step"] = self.step
        if self.waits:
            out["waits"] = list(self.waits)
        return out


@dataclass
class NodeRender:
    """Everything one node runs, and the files that make it run it."""

    node: Node
    instance_type: str
    services: list[Service]
    files: dict[str, tuple[str, int]] = field(default_factory=dict)
    units: list[str] = field(default_factory=list)
    wants: list[str] = field(default_factory=list)
    scripts: set[str] = field(default_factory=set)
    # Files the same on every node that has them (the API gate's configuration): shipped in the
    # scripts asset, not in each node's user data (16 KB at most).
    shared: dict[str, tuple[str, int]] = field(default_factory=dict)

    @property
    def servers(self) -> list[Service]:
        """The vLLM servers this node runs (not its proxy, router or benchmark legs)."""
        return [s for s in self.services if s.argv[:2] == ["vllm", "serve"]]

    def as_json(self) -> dict[str, object]:
        """The `plan --json` form of this node."""
        return {
            "name": self.node.name,
            "role": self.node.role,
            "instance_type": self.instance_type,
            "replicas": len(self.node.replicas),
            "idle_cores": self.node.idle_cores,
            "services": [s.as_json() for s in self.services],
        }


def exec_line(argv: list[str]) -> str:
    """A unit's ExecStart line: every argument quoted for systemd."""
    return " ".join(systemd_quote(a) for a in argv)


def served(argv: list[str]) -> list[str]:
    """The command a unit's ExecStart finally runs: what follows its waits' last `--`."""
    return argv[len(argv) - argv[::-1].index("--") :] if "--" in argv else argv[2:]


def unit_limits(cfg: ClusterConfig) -> dict[str, int]:
    """The start and restart bounds every server unit's template takes."""
    return {
        # Start jobs end when the main process runs (Type=exec); only the back-off before a
        # restart takes time in ExecStartPre. The long waits run inside the process.
        "backoff_timeout_s": BACKOFF_MAX_S + 60,
        "restart_sec": RESTART_SEC,
    }


def unit_file(name: str, **values: object) -> tuple[str, int]:
    """A unit as a node receives it: its comment lines stay in the repository's template (the user
    data is limited to 16 KB per node and the template to 1 MB per stack; they cost ~0.9 KB a node)."""
    text = _TEMPLATES.get_template(f"{name}.j2").render(**values)
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#")), 0o644
