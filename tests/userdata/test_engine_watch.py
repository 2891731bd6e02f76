"""The collector's engine watch: a hung engine is killed after engine_hang_s, a slow or idle one never;
a replacement the health watch holds is published."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clusterspec.loading import load_config
from node_render import telemetry
from tests.conftest import fake_command
from tests.userdata.test_telemetry import _states_collector, _values

Shipped = Callable[[str], Path]


class _Engine(http.server.BaseHTTPRequestHandler):
    """A vLLM server's /health and /metrics, its gauges and token counters set by the test."""

    running, waiting, tokens = 0.0, 0.0, 0.0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        cls = type(self)
        body = "ok" if self.path == "/health" else (
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {cls.running}\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {cls.waiting}\n'
            f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {cls.tokens}\n'
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {cls.tokens / 8}\n'
        )  # fmt: skip
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_a_hung_engine_is_killed_after_engine_hang_s_and_a_slow_or_idle_one_never(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three servers whose /health all answer: one holds requests and counts no token (hung), one is
    saturated (requests waiting, tokens counted), one is idle (no request, no token). With
    healing.engine_hang_s=120 and the collector every 60 s, only the hung one's unit is killed, once,
    at the first interval 120 s after its tokens stopped, with the evidence in the journal."""
    engines = {"hung": type("H", (_Engine,), {"running": 4.0, "waiting": 2.0, "tokens": 9000.0}),
               "busy": type("B", (_Engine,), {"running": 4.0, "waiting": 12.0, "tokens": 0.0}),
               "idle": type("I", (_Engine,), {"tokens": 500.0})}  # fmt: skip
    servers, http_servers = [], []
    for i, (name, handler) in enumerate(engines.items()):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        http_servers.append(srv)
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        servers.append({"name": f"prefill-0/{name}", "unit": f"gptoss-prefill@{i}.service", "health_url": f"{base}/health", "metrics_url": f"{base}/metrics"})
    try:
        mod, c, _ = _states_collector(tmp_path, monkeypatch, {s["unit"]: "ActiveState=active" for s in servers}, servers)
        kills = tmp_path / "kills"
        fake_command(tmp_path / "wrap", "systemctl", f'if [ "$1" = kill ]; then echo "$@" >> "{kills}"; exit 0; fi\nexec "{tmp_path / "systemctl"}" "$@"\n')
        mod.SYSTEMCTL = str(tmp_path / "wrap" / "systemctl")
        c.cfg["hang_s"] = 120
        for step, now in enumerate((1000.0, 1060.0, 1119.0, 1120.0, 1180.0, 1239.0)):
            engines["busy"].tokens = 4096.0 * step  # a saturated engine still counts tokens
            c.collect(now)
            if now == 1119.0:
                assert not kills.exists(), "119 s without a token is not yet 120"
        assert kills.read_text().splitlines() == ["kill --signal=SIGKILL gptoss-prefill@0.service"], "the hung one, once (the next verdict waits another 120 s)"
        out = capsys.readouterr().out.splitlines()
        said = [line for line in out if "hung" in line]
        assert said == ["gptoss-telemetry: gptoss-prefill@0.service hung: 6 requests in its engine and no token for 120s "
                        "(healing.engine_hang_s=120) while /health answers; killing it (systemd starts it again)"], out  # fmt: skip
        # engine_hang_s=0 turns the watch off.
        c.cfg["hang_s"] = 0
        kills.unlink()
        for now in (2000.0, 3000.0, 4000.0):
            c.collect(now)
        assert not kills.exists()
    finally:
        for srv in http_servers:
            srv.shutdown()
            srv.server_close()


def test_the_engine_watch_gets_its_bound_from_the_spec() -> None:
    cfg = load_config({"healing.engine_hang_s": 900})
    node = cfg.layout.nodes[0]
    doc = json.loads(telemetry.node_config(cfg, node, [], []))
    assert doc["hang_s"] == 900 and json.loads(telemetry.node_config(load_config({}), node, [], []))["hang_s"] == 600


def test_a_held_replacement_is_published_while_the_health_watch_holds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gptoss-health-watch writes watch/budget-spent (with the reason) when a budget stops it from asking
    for a replacement, and removes it when nothing is wanted: ReplacementHeld is 1 exactly then."""
    mod, c, _ = _states_collector(tmp_path, monkeypatch, {})
    monkeypatch.setattr(mod, "RUN_DIR", tmp_path / "run")
    assert _values(c.collect(1000.0))["ReplacementHeld"] == 0
    (tmp_path / "run" / "watch").mkdir(parents=True)
    (tmp_path / "run" / "watch" / "budget-spent").write_text("prefill-1 was replaced 2 times in the last 21600s (its budget is 2): ...\n")
    assert _values(c.collect(1060.0))["ReplacementHeld"] == 1
    (tmp_path / "run" / "watch" / "budget-spent").unlink()
    assert _values(c.collect(1120.0))["ReplacementHeld"] == 0
