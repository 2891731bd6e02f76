"""What a ready node runs and answers: the units and health routes gptoss-status and the deploy gate check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from clusterspec.config import ClusterConfig
from node_render.command_lines import health_url


class _Service(Protocol):
    @property
    def unit(self) -> str: ...
    @property
    def environment(self) -> Mapping[str, str]: ...


class NodeRender(Protocol):
    """What these checks read of a node's rendering (node_render.render.NodeRender)."""

    @property
    def services(self) -> Sequence[_Service]: ...
    @property
    def units(self) -> Sequence[str]: ...


def health_checks(cfg: ClusterConfig, render: NodeRender) -> list[tuple[str, str | None, str | None]]:
    """(unit, local health URL or None, phase name or None) for every unit a ready node runs."""
    s = cfg.serving
    checks: list[tuple[str, str | None, str | None]] = [
        ("gptoss-scripts.service", None, None),
        ("gptoss-nvme.service", None, None),
        ("gptoss-identity.service", None, None),
        ("gptoss-node-check.service", None, None),
        ("gptoss-stage.service", None, None),
    ]
    for svc in render.services:
        if svc.unit == "gptoss-decode.service":
            checks.append((svc.unit, health_url("127.0.0.1", s.decode.http_port, s.server_health_path), "decode"))
        elif svc.unit == "gptoss-server.service":
            checks.append((svc.unit, health_url("127.0.0.1", s.server.port, s.server_health_path), "server"))
        elif svc.unit.startswith("gptoss-prefill@"):
            port = int(svc.environment["GPTOSS_HTTP_PORT"])
            index = svc.unit.split("@")[1].split(".")[0]
            checks.append((svc.unit, health_url("127.0.0.1", port, s.server_health_path), f"prefill_{index}"))
        elif svc.unit == "gptoss-proxy.service":
            checks.append((svc.unit, health_url("127.0.0.1", s.proxy.port, cfg.proxy_health_path), "proxy"))
            if cfg.proxy_kind == "toy":
                checks.append(("gptoss-group-health.service", health_url("127.0.0.1", s.proxy.group_health_port, "/ready"), None))
    if "gptoss-api.service" in render.units:
        checks.append(("gptoss-api.service", None, None))  # its answers: the proxy's check above goes through it
    # The members' and the health watch's timers (their runs come and go; the timer stays active).
    checks += [(u, None, None) for u in render.units if u.endswith(".timer")]
    if cfg.observability.enabled:
        checks.append(("gptoss-telemetry.service", None, None))
    return checks


def health_file(cfg: ClusterConfig, render: NodeRender) -> str:
    """`unit url phase` lines read by gptoss-status (`-` where there is none)."""
    return "".join(f"{unit} {url or '-'} {phase or '-'}\n" for unit, url, phase in health_checks(cfg, render))
