"""gptoss-telemetry run for real as shipped: every catalog metric in a payload CloudWatch accepts
(botocore's own model of PutMetricData), units, servers, the heartbeat, a Capacity Block's hours."""

from __future__ import annotations

import hashlib
import http.server
import importlib.machinery
import importlib.util
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import botocore.session
import pytest
from botocore.validate import validate_parameters

from node_render import telemetry
from node_render.paths import USERDATA_DIR
from tests.conftest import fake_command

Shipped = Callable[[str], Path]


# ---- gptoss-telemetry -------------------------------------------------------------------------------


def _collector() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("gptoss_telemetry", str(USERDATA_DIR / "bin" / "gptoss-telemetry"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


class _VllmMetrics(http.server.BaseHTTPRequestHandler):
    """A vLLM server's /metrics (0.11 names) whose counters the test advances."""

    n = 0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        n = type(self).n
        if self.path == "/router-metrics":  # vllm-router 0.1.17's names: 10 requests and 1 decode error per step
            body = (
                f'vllm_router_pd_requests_total{{route="/v1/completions"}} {10.0 * n}\n'
                f'vllm_router_pd_decode_errors_total{{worker="http://10.0.0.2:8200"}} {1.0 * n}\n'
                f'vllm_router_retries_total{{route="/v1/completions"}} {2.0 * n}\n'
                'vllm_router_worker_health{worker="http://10.0.0.1:8100"} 1\n'
                'vllm_router_worker_health{worker="http://10.0.0.2:8200"} 0\n'
                'vllm_router_pd_pending_decode_requests{worker="http://10.0.0.3:8200",rank="aggregate"} 4\n'
                f'vllm_router_pd_request_duration_seconds_sum{{route="/v1/completions"}} {2.5 * n}\n'
                f'vllm_router_pd_request_duration_seconds_count{{route="/v1/completions"}} {10.0 * n}\n'
            )
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        body = "ok" if self.path == "/health" else (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {8192.0 * n}\n'
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {1024.0 * n}\n'
            f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} {0.5 * n}\n'
            f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {1.0 * n}\n'
            f'vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {0.01 * 1024 * n}\n'
            f'vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {1024.0 * n}\n'
        )  # fmt: skip
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _validate(operation: str, service: str, params: dict[str, Any]) -> None:
    model = botocore.session.get_session().get_service_model(service)
    validate_parameters(params, model.operation_model(operation).input_shape)


def test_collector_publishes_every_catalog_metric_in_a_payload_cloudwatch_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = type("V", (_VllmMetrics,), {"n": 1})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    ib = tmp_path / "infiniband"
    for dev in ("rdmap0s0", "rdmap1s0"):
        (ib / dev / "ports/1/hw_counters").mkdir(parents=True)
    report = {"neuron_runtime_data": [{"report": {"neuroncore_counters": {"neuroncores_in_use": {"0": {"neuroncore_utilization": 80.0},
              "1": {"neuroncore_utilization": 60.0}}}, "memory_used": {"neuron_runtime_used_bytes": {"neuron_device": 2**30}},
              "execution_stats": {"error_summary": {"generic": 0, "numerical": 1}}}}]}  # fmt: skip
    fake_command(tmp_path, "neuron-monitor", f"echo '{json.dumps(report)}'\nsleep 30\n")
    stage_state = tmp_path / "stage.state"
    stage_state.write_text("ActiveState=activating\nSubState=auto-restart\nNRestarts=1\n")
    fake_command(
        tmp_path,
        "systemctl",
        f'for u; do case $u in -* | show) ;; gptoss-stage.service) cat "{stage_state}"; echo ;; *) echo ActiveState=active; echo ;; esac; done\n',
    )
    for k, v in {"GPTOSS_SYS_INFINIBAND": str(ib), "GPTOSS_NEURON_MONITOR": str(tmp_path / "neuron-monitor"),
                 "GPTOSS_SYSTEMCTL": str(tmp_path / "systemctl"), "GPTOSS_STATE_DIR": str(tmp_path / "state")}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    mod = _collector()
    # The node's API gate: the real HAProxy, in front of a stand-in router whose answers each request chooses.
    from clusterspec.sections.proxy import Proxy
    from tests.api_gate import start_gate
    from tests.userdata.api_gate_peers import Upstream, _port, request

    upstream = Upstream()
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    from node_render.haproxy import KeyCheck

    # With API keys: team-a, and 'limited' at 1 request a second (the maps gptoss-keys writes: sha256 -> name, name -> limit).
    folder = tmp_path / "gate"
    folder.mkdir()
    keys = KeyCheck(requests_per_s=100, concurrency=100, keys_map=str(folder / "k.map"), rate_map=str(folder / "r.map"), concurrency_map=str(folder / "c.map"))
    (folder / "k.map").write_text("".join(f"{hashlib.sha256(k.encode()).hexdigest().upper()} {n}\n" for n, k in (("team-a", "a" * 32), ("limited", "l" * 32))))
    (folder / "r.map").write_text("limited 1\n")
    (folder / "c.map").write_text("")
    gate = start_gate(folder, Proxy(), host="127.0.0.1", port=_port(), router_port=upstream.server_address[1], keys=keys)

    def completion(port: int, **doc: Any) -> tuple[int, bytes]:
        status, body, _ = request(port, "POST", "/v1/completions", json.dumps({"model": "m", "prompt": "p", **doc}).encode(), {"Authorization": "Bearer " + "a" * 32})
        return status, body
    cfg = {"namespace": "GptOss/c1", "region": "us-east-2", "cluster": "c1", "node": "decode-0", "role": "decode", "interval_s": 60,
           "log_group": "/gptoss/c1", "efa": True, "metrics": [m.name for m in telemetry.ALL_METRICS],
           "servers": [{"name": "decode-0/decode", "unit": "gptoss-decode.service", "health_url": f"{base}/health", "metrics_url": f"{base}/metrics"}],
           "units": ["gptoss-stage.service", "gptoss-decode.service"], "router_metrics_url": f"{base}/router-metrics",
           "gate_socket": str(gate.socket_dir / "haproxy.sock"), "block": "cr-0123456789abcdef0"}  # fmt: skip
    # The AWS CLI's answer for the block's end date (--output text).
    fake_command(tmp_path, "aws-block", 'echo 2099-01-01T00:00:00+00:00\n')
    monkeypatch.setattr(mod, "AWS", str(tmp_path / "aws-block"))
    try:
        for dev in ("rdmap0s0", "rdmap1s0"):
            (ib / dev / "ports/1/hw_counters/rx_bytes").write_text("1000\n")
            (ib / dev / "ports/1/hw_counters/tx_bytes").write_text("500\n")
        c = mod.Collector(cfg)
        import time

        for _ in range(50):
            if c.neuron.report:
                break
            time.sleep(0.1)
        c.collect(1000.0)
        handler.n = 11  # ten more requests in 60 s
        for i in range(20):  # and 20 through the gate whose first attempt the router answered 500: 20 retries
            assert completion(gate.port, id=f"r{i}", answers=[500])[0] == 200
        limited = [request(gate.port, "POST", "/v1/completions", b"{}", {"Authorization": "Bearer " + "l" * 32})[0] for _ in range(3)]
        assert limited == [200, 429, 429]
        for dev in ("rdmap0s0", "rdmap1s0"):
            (ib / dev / "ports/1/hw_counters/rx_bytes").write_text(str(1000 + 6_000_000) + "\n")
            (ib / dev / "ports/1/hw_counters/tx_bytes").write_text(str(500 + 600_000) + "\n")
        data = c.collect(1060.0)
    finally:
        server.shutdown()
        gate.stop()
        upstream.shutdown()
        if c.neuron and c.neuron.proc:
            c.neuron.proc.kill()
    values = {d["MetricName"]: d["Value"] for d in data}
    assert values["PromptTokensPerSecond"] == pytest.approx(8192 * 10 / 60)
    assert values["GenerationTokensPerSecond"] == pytest.approx(1024 * 10 / 60)
    assert values["TimeToFirstTokenMs"] == pytest.approx(500.0) and values["TimePerOutputTokenMs"] == pytest.approx(10.0)
    assert (values["RequestsRunning"], values["RequestsWaiting"], values["KvCacheUsagePercent"], values["ServerUp"]) == (
        3,
        1,
        25,
        1,
    )
    assert (
        values["NeuronCoreUtilizationPercent"] == 70
        and values["NeuronDeviceMemoryUsedBytes"] == 2**30
        and values["NeuronExecutionErrors"] == 1
    )
    assert values["EfaRxBytesPerSecond"] == pytest.approx(2 * 6_000_000 / 60) and values["EfaTxBytesPerSecond"] == pytest.approx(
        2 * 600_000 / 60
    )
    assert (values["UnitsNotReady"], values["StagingFailing"], values["ServersDown"]) == (1, 1, 0)
    assert values["RouterRequestsPerSecond"] == pytest.approx(100 / 60, abs=1e-5) and values["RouterErrorsPerSecond"] == pytest.approx(10 / 60, abs=1e-5)
    assert values["RouterErrorPercent"] == pytest.approx(10.0) and values["GateRetriesPerSecond"] == pytest.approx(20 / 60, abs=1e-5)
    assert (values["RouterUnhealthyServers"], values["RouterPendingDecode"], values["RouterRequestMs"]) == (1, 4, pytest.approx(250.0))
    # Staged: the same collector reports it (the decode server is gone by now: one unit not ready).
    stage_state.write_text("ActiveState=active\nSubState=exited\nNRestarts=1\n")
    again = {d["MetricName"]: d["Value"] for d in c.collect(1120.0)}
    assert (again["StagingFailing"], again["ServersDown"]) == (0, 1)
    # Per key (its name, never the key), summed by Cluster and Key: team-a's 20 requests, limited's 1 served and 2 refused.
    per_key = {(d["MetricName"], {x["Name"]: x["Value"] for x in d["Dimensions"]}["Key"]): d["Value"] for d in data if d["MetricName"].startswith("Key")}
    assert {k: v for k, v in per_key.items() if k[0] != "KeyBytesOut"} == {
        ("KeyRequests", "team-a"): 20, ("KeyLimited", "team-a"): 0, ("KeyServerErrors", "team-a"): 0,
        ("KeyRequests", "limited"): 3, ("KeyLimited", "limited"): 2, ("KeyServerErrors", "limited"): 0}, per_key
    assert per_key[("KeyBytesOut", "team-a")] > 20 * 100 and per_key[("KeyBytesOut", "limited")] > 0
    # Every metric of the catalog comes out, with its dimensions, in a payload the API accepts.
    assert set(values) == {m.name for m in telemetry.ALL_METRICS}
    by_name = {d["MetricName"]: {x["Name"] for x in d["Dimensions"]} for d in data}
    assert by_name["TimeToFirstTokenMs"] == {"Cluster", "Node", "Role", "Server"} and by_name["UnitsNotReady"] == {"Cluster"}
    assert by_name["KeyRequests"] == {"Cluster", "Key"}
    _validate("PutMetricData", "cloudwatch", {"Namespace": "GptOss/c1", "MetricData": data})


def _states_collector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, units: dict[str, str], servers: list[dict[str, str]] | None = None) -> Any:
    """A collector over units whose `systemctl show` blocks the test writes (no metrics server, no neuron-monitor)."""
    states = tmp_path / "states.json"
    states.write_text(json.dumps(units))
    fake_command(
        tmp_path, "systemctl",
        f'python3 -c \'import json,sys; s=json.load(open("{states}")); print("\\n\\n".join(s.get(u, "ActiveState=active") for u in sys.argv[1:] if u.endswith((".service", ".timer"))))\' "$@"\n',
    )  # fmt: skip
    monkeypatch.setenv("GPTOSS_SYSTEMCTL", str(tmp_path / "systemctl"))
    monkeypatch.setenv("GPTOSS_STATE_DIR", str(tmp_path / "state"))
    mod = _collector()
    cfg = {"namespace": "GptOss/c1", "region": "us-east-2", "cluster": "c1", "node": "prefill-0", "role": "prefill", "interval_s": 60,
           "log_group": "/gptoss/c1", "efa": False, "neuron": False, "metrics": [m.name for m in telemetry.ALL_METRICS],
           "servers": servers or [], "units": list(units)}  # fmt: skip
    return mod, mod.Collector(cfg), states


def _values(data: list[dict[str, Any]]) -> dict[str, float]:
    return {d["MetricName"]: d["Value"] for d in data}


def test_units_not_ready_is_zero_on_a_healthy_node_whose_oneshots_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A timer's service between two runs and the signal that already reported are done, not "not
    ready" (the metric could never be 0 before); a stopped server, a failed oneshot, a starting unit are."""
    done = "ActiveState=inactive\nSubState=dead\nType=oneshot\nResult=success\nNRestarts=0"
    healthy = {"gptoss-members.service": done, "gptoss-signal.service": done, "gptoss-health-watch.service": done,
               "gptoss-decode.service": "ActiveState=active\nSubState=running\nType=exec\nResult=success\nNRestarts=0"}  # fmt: skip
    _, c, states = _states_collector(tmp_path, monkeypatch, healthy)
    assert _values(c.collect(1000.0))["UnitsNotReady"] == 0
    for unit, state in (("gptoss-decode.service", "ActiveState=inactive\nSubState=dead\nType=exec\nResult=success\nNRestarts=0"),
                        ("gptoss-signal.service", "ActiveState=failed\nSubState=failed\nType=oneshot\nResult=exit-code\nNRestarts=0"),
                        ("gptoss-members.service", "ActiveState=activating\nSubState=start\nType=oneshot\nResult=success\nNRestarts=0")):  # fmt: skip
        states.write_text(json.dumps(healthy | {unit: state}))
        assert _values(c.collect(1000.0))["UnitsNotReady"] == 1, unit


def test_staging_failing_counts_a_failed_nvme_step_under_an_inactive_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    units = {"gptoss-nvme.service": "ActiveState=failed\nSubState=failed\nType=oneshot\nResult=exit-code\nNRestarts=0",
             "gptoss-stage.service": "ActiveState=inactive\nSubState=dead\nType=oneshot\nResult=success\nNRestarts=0"}  # fmt: skip
    _, c, _ = _states_collector(tmp_path, monkeypatch, units)
    assert _values(c.collect(1000.0))["StagingFailing"] == 1


def test_servers_down_remembers_what_answered_across_a_restart_of_the_collector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("V", (_VllmMetrics,), {"n": 1}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    servers = [{"name": "prefill-0/prefill@0", "unit": "gptoss-prefill@0.service", "health_url": f"{base}/health", "metrics_url": f"{base}/metrics"}]
    try:
        _, first, _ = _states_collector(tmp_path, monkeypatch, {"gptoss-prefill@0.service": "ActiveState=active"}, servers)
        assert _values(first.collect(1000.0))["ServersDown"] == 0
    finally:
        server.shutdown()
        server.server_close()
    # The collector restarts (a crash, a reboot): it still knows the server answered on this instance.
    _, again, _ = _states_collector(tmp_path, monkeypatch, {"gptoss-prefill@0.service": "ActiveState=active"}, servers)
    assert _values(again.collect(1060.0))["ServersDown"] == 1


def test_the_heartbeat_is_published_with_the_nodes_dimensions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, c, _ = _states_collector(tmp_path, monkeypatch, {})
    (beat,) = [d for d in c.collect(1000.0) if d["MetricName"] == "NodeReporting"]
    assert beat["Value"] == 1 and {x["Name"]: x["Value"] for x in beat["Dimensions"]} == {"Cluster": "c1", "Node": "prefill-0", "Role": "prefill"}


def test_a_neuron_monitor_that_stopped_reporting_is_not_published_as_current(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_command(tmp_path, "neuron-monitor", "echo '{\"neuron_runtime_data\": []}'\nsleep 30\n")
    monkeypatch.setenv("GPTOSS_NEURON_MONITOR", str(tmp_path / "neuron-monitor"))
    mod = _collector()
    monitor = mod.NeuronMonitor(60)
    try:
        for _ in range(50):
            if monitor.report:
                break
            time.sleep(0.1)
        assert monitor.values() != {}, "a fresh report is published"
        monitor.report_at -= 181  # its last report is three periods old: neuron-monitor hung or exited
        assert monitor.values() == {}
    finally:
        assert monitor.proc is not None
        monitor.proc.kill()


def test_collector_ships_every_units_journal_to_the_nodes_one_stream_in_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [{"__CURSOR": f"c{i}", "_SYSTEMD_UNIT": u, "__REALTIME_TIMESTAMP": str(1_700_000_000_000_000 + i), "MESSAGE": m}
               for i, (u, m) in enumerate([("gptoss-decode.service", "fake vllm: compiling"), ("gptoss-stage.service", "staged"),
                                           ("gptoss-decode.service", [104, 105])])]  # fmt: skip
    journal = tmp_path / "journal.jsonl"
    journal.write_text("".join(json.dumps(e) + "\n" for e in entries))
    fake_command(tmp_path, "journalctl", f'echo "$*" >>"{tmp_path}/journalctl.args"\ncat "{journal}"\n')
    fake_command(
        tmp_path,
        "aws",
        f'echo "$*" >>"{tmp_path}/aws.log"\nfor a; do case $a in file://*) cp "${{a#file://}}" "{tmp_path}/payload-$(date +%s%N).json";; esac; done\n',
    )
    monkeypatch.setenv("GPTOSS_JOURNALCTL", str(tmp_path / "journalctl"))
    monkeypatch.setenv("GPTOSS_AWS", str(tmp_path / "aws"))
    monkeypatch.setenv("GPTOSS_STATE_DIR", str(tmp_path / "state"))
    mod = _collector()
    cfg = {
        "region": "us-east-2",
        "node": "decode-0",
        "log_group": "/gptoss/c1",
        "units": ["gptoss-decode.service", "gptoss-stage.service"],
    }
    mod.ship_logs(cfg, set())
    calls = (tmp_path / "aws.log").read_text().splitlines()
    # Two units' lines, one stream made once and one call: each line after its unit's name, in journal order.
    assert [c.split(" --log-stream-name ")[1].split()[0] for c in calls] == ["decode-0/journal", "decode-0/journal"]
    assert [c.split()[1] for c in calls] == ["create-log-stream", "put-log-events"]
    (payload,) = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("payload-*.json"))]
    assert [e["message"] for e in payload] == ["gptoss-decode.service: fake vllm: compiling", "gptoss-stage.service: staged",
                                               "gptoss-decode.service: hi"]  # fmt: skip
    _validate("PutLogEvents", "logs", {"logGroupName": "/gptoss/c1", "logStreamName": "decode-0/journal", "logEvents": payload})
    assert (tmp_path / "state/telemetry.cursor").read_text() == "c2"
    mod.ship_logs(cfg, {"decode-0/journal"})
    assert "--after-cursor c2" in (tmp_path / "journalctl.args").read_text().splitlines()[-1]


def test_a_burst_of_journal_lines_is_shipped_in_calls_within_cloudwatch_limits() -> None:
    """A crash-looping server can write megabytes between two rounds: no call may exceed 1 MB or 10,000 events."""
    mod = _collector()
    big = [{"timestamp": i, "message": "x" * 150_000} for i in range(20)]
    many = [{"timestamp": i, "message": "y"} for i in range(25_000)]
    for events in (big, many):
        batches = mod.log_batches(events)
        assert [e for b in batches for e in b] == events
        for b in batches:
            assert len(b) <= 10_000 and sum(len(e["message"]) + 26 for e in b) <= 1_048_576
    assert len(mod.log_batches(big)) == 4 and len(mod.log_batches(many)) == 3


def test_a_capacity_blocks_hours_left_come_from_ec2_and_follow_an_extension(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector asks EC2 (the AWS CLI, as the node runs it: here a stand-in printing what
    `--query CapacityReservations[0].EndDate --output text` prints) for its block's end, publishes the hours
    until EC2 starts reclaiming it (the end less 30 min), asks again after 10 minutes (an extension moves
    the end), and keeps the last answer through a failed call."""
    import datetime as dt
    import time as clock

    mod, c, _ = _states_collector(tmp_path, monkeypatch, {})
    c.cfg["block"] = "cr-0123456789abcdef0"
    end = tmp_path / "end"
    calls = tmp_path / "calls"
    fake_command(tmp_path, "aws", f'echo "$*" >> "{calls}"\n[ -s "{end}" ] || exit 254\ncat "{end}"\n')
    monkeypatch.setattr(mod, "AWS", str(tmp_path / "aws"))
    in_26h = dt.datetime.fromtimestamp(clock.time() + 26 * 3600 + 1800, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00")
    end.write_text(in_26h + "\n")
    assert _values(c.collect(1000.0))["CapacityBlockHoursLeft"] == pytest.approx(26, abs=0.05)
    assert calls.read_text().split("\n")[0] == ("ec2 describe-capacity-reservations --capacity-reservation-ids cr-0123456789abcdef0 "
                                                "--query CapacityReservations[0].EndDate --output text")  # fmt: skip
    end.write_text(dt.datetime.fromtimestamp(clock.time() + 74 * 3600 + 1800, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00") + "\n")
    assert _values(c.collect(1300.0))["CapacityBlockHoursLeft"] == pytest.approx(26, abs=0.05), "asked again only after 10 minutes"
    assert _values(c.collect(1700.0))["CapacityBlockHoursLeft"] == pytest.approx(74, abs=0.05), "extended by 48 h"
    end.write_text("")  # EC2 does not answer: the last end date stands
    assert _values(c.collect(2400.0))["CapacityBlockHoursLeft"] == pytest.approx(74, abs=0.05)
    assert calls.read_text().count("describe-capacity-reservations") == 3
    assert not (Path(os.environ["GPTOSS_RUN_DIR"]) / "block-draining").exists(), "74 h left: nothing drains"
    # Within block_drain_s (the request timeout and a minute, rendered) of EC2's reclaim: the node drains, once.
    api_calls = tmp_path / "api"
    fake_command(tmp_path, "gptoss-api", f'echo "$*" >> "{api_calls}"\n')
    monkeypatch.setattr(mod, "API", str(tmp_path / "gptoss-api"))
    c.cfg |= {"block_drain_s": 1860, "block_retry_after_s": 600, "gate_socket": "/run/gptoss/haproxy.sock"}
    end.write_text(dt.datetime.fromtimestamp(clock.time() + 1500 + 1800, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00") + "\n")
    assert _values(c.collect(3100.0))["CapacityBlockHoursLeft"] == pytest.approx(1500 / 3600, abs=0.01)
    marker = Path(os.environ["GPTOSS_RUN_DIR"]) / "block-draining"
    assert marker.exists() and api_calls.read_text() == "drain 600\n", "the gate takes nothing new, answers 503 with Retry-After"
    # Its servers leave every router until the reclaim (their health route answers 503 while this file holds).
    until = float((Path(os.environ["GPTOSS_RUN_DIR"]) / "servers-draining").read_text())
    assert until == pytest.approx(clock.time() + 1500, abs=60), "the servers' drain lasts until EC2 reclaims the block"
    c.collect(3800.0)
    assert api_calls.read_text() == "drain 600\n", "once"
    assert not (Path(os.environ["GPTOSS_RUN_DIR"]) / "block-stopped").exists(), "the servers serve while the routers' streams end"


def test_a_blocks_servers_stop_before_the_reclaim_so_that_the_routers_see_them_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """block_stop_s before EC2 starts reclaiming (two intervals and a minute: the rendered 180 s for a 60 s interval), the
    node's servers stop, once, and never before; a node whose servers stopped is draining too (no replacement asked for).
    An extension that moves the end out of the drain undoes both."""
    import datetime as dt
    import time as clock

    from clusterspec.loading import load_config

    cfg = load_config({"capacity": {"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0"}})
    assert telemetry.block_stop_s(cfg) == 180
    servers = [{"name": f"prefill-0 replica {i}", "unit": f"gptoss-prefill@{i}.service", "health_url": "http://127.0.0.1:9/health"} for i in range(2)]
    mod, c, _ = _states_collector(tmp_path, monkeypatch, {}, servers)
    stops = tmp_path / "stops"
    show = tmp_path / "systemctl"
    fake_command(tmp_path, "systemctl-recording", f'case $1 in stop|start) echo "$*" >> "{stops}"; exit 0 ;; esac\nexec "{show}" "$@"\n')
    api_calls = tmp_path / "api"
    fake_command(tmp_path, "gptoss-api", f'echo "$*" >> "{api_calls}"\n')
    monkeypatch.setattr(mod, "API", str(tmp_path / "gptoss-api"))
    monkeypatch.setattr(mod, "SYSTEMCTL", str(tmp_path / "systemctl-recording"))
    end = tmp_path / "end"
    fake_command(tmp_path, "aws", f'cat "{end}"\n')
    monkeypatch.setattr(mod, "AWS", str(tmp_path / "aws"))
    c.cfg |= {"block": "cr-0123456789abcdef0", "block_drain_s": 1860, "block_stop_s": 180, "gate_socket": "/run/gptoss/haproxy.sock"}
    run_dir = Path(os.environ["GPTOSS_RUN_DIR"])

    def reclaimed_in(seconds: float) -> None:
        end.write_text(dt.datetime.fromtimestamp(clock.time() + seconds + 1800, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00") + "\n")
        c.previous.pop("block", None)  # asked of EC2 again now, not after 10 minutes

    c.ever_up = {s["name"] for s in servers}  # both answered earlier; their health URLs answer nothing now
    reclaimed_in(600)
    assert _values(c.collect(1000.0))["ServersDown"] == 2, "down while the block runs: the ServersDown alarm's to say"
    assert (run_dir / "block-draining").exists() and not stops.exists(), "draining, the servers still serve"
    reclaimed_in(150)
    c.collect(1060.0)
    assert stops.read_text() == "stop --no-block gptoss-prefill@0.service gptoss-prefill@1.service\n"
    reclaimed_in(90)
    assert _values(c.collect(1120.0))["ServersDown"] == 0, "stopped on purpose before the reclaim: nothing pages"
    assert stops.read_text().count("stop") == 1, "once"
    # An extension bought in the block's last minutes: EC2's end moves out; the node serves again, once.
    reclaimed_in(3 * 3600)
    c.collect(1180.0)
    assert stops.read_text().splitlines()[-1] == "start --no-block gptoss-prefill@0.service gptoss-prefill@1.service"
    assert api_calls.read_text() == "drain 600\nundrain\n"
    assert not (run_dir / "block-draining").exists() and not (run_dir / "block-stopped").exists(), "healing and ServersDown as before"
    assert not (run_dir / "servers-draining").exists(), "the servers answer their health route: the routers take them back"
    reclaimed_in(3 * 3600)
    c.collect(1240.0)
    assert stops.read_text().count("start") == 1 and api_calls.read_text().count("undrain") == 1, "once"
