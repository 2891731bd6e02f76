"""What a node says of its own health, run for real as shipped: gptoss-status, gptoss-group-health (the
load balancer's check of a toy proxy's group) and gptoss-health-watch (which asks its group for a
replacement, within budgets, for hardware causes only)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from node_render.paths import USERDATA_DIR
from tests.conftest import fake_command, real_aws_cli
from tests.local_moto import free_port

Shipped = Callable[[str], Path]



# ---- gptoss-status and gptoss-group-health ---------------------------------------------------------


def test_status_reports_state_restarts_phase_and_the_last_log_line_of_what_is_not_ready(tmp_path: Path, health_server: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}/health"
    (tmp_path / "health").write_text(
        f"gptoss-stage.service - -\ngptoss-prefill@0.service {health_server}/health prefill_0\ngptoss-prefill@1.service {dead} prefill_1\n"
    )
    (tmp_path / "cluster.env").write_text("GPTOSS_NODE=prefill-0\n")
    (tmp_path / "run/phase").mkdir(parents=True)
    (tmp_path / "run/phase/prefill_1").write_text("waiting for the node's first replica to answer\n")
    states = {"gptoss-stage.service": "ActiveState=activating\nSubState=auto-restart\nNRestarts=3\nResult=exit-code",
              "gptoss-prefill@0.service": "ActiveState=active\nSubState=running\nNRestarts=0\nResult=success",
              "gptoss-prefill@1.service": "ActiveState=active\nSubState=running\nNRestarts=0\nResult=success"}  # fmt: skip
    (tmp_path / "states.json").write_text(json.dumps(states))
    systemctl = fake_command(
        tmp_path,
        "systemctl",
        f'python3 -c \'import json,sys; print(json.load(open("{tmp_path}/states.json"))[sys.argv[1]])\' "${{@: -1}}"\n',
    )
    journalctl = fake_command(tmp_path, "journalctl", 'u=${*: -1}; echo "older line"; echo "last line of ${u#_SYSTEMD_UNIT=}"\n')
    res = subprocess.run(
        [str(USERDATA_DIR / "bin/gptoss-status")], capture_output=True, text=True, check=True,
        env={**os.environ, "GPTOSS_HEALTH_FILE": str(tmp_path / "health"), "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"),
             "GPTOSS_RUN_DIR": str(tmp_path / "run"), "GPTOSS_SYSTEMCTL": str(systemctl), "GPTOSS_JOURNALCTL": str(journalctl)},
    )  # fmt: skip
    doc = json.loads(res.stdout)
    assert doc["node"] == "prefill-0"
    stage, r0, r1 = doc["units"]
    assert (stage["state"], stage["sub"], stage["restarts"], stage["healthy"]) == ("activating", "auto-restart", 3, None)
    assert stage["last_log"].endswith("last line of gptoss-stage.service")
    assert (r0["healthy"], "last_log" in r0) == (True, False)
    assert (r1["healthy"], r1["phase"]) == (False, "waiting for the node's first replica to answer")


def test_group_health_is_ready_only_when_every_server_of_the_group_answers(health_server: str) -> None:
    port = free_port()
    dead_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(USERDATA_DIR / "bin/gptoss-group-health"), str(port), f"{health_server}/health",
         f"http://127.0.0.1:{dead_port}/health"],
        env={**os.environ, "GPTOSS_GROUP_POLL_S": "0.2"},
    )  # fmt: skip
    try:
        import urllib.error
        import urllib.request

        def ready() -> tuple[int, dict[str, Any]]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=3) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        for _ in range(50):
            try:
                status, doc = ready()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.5)
        status, doc = ready()
        assert (status, doc["down"]) == (503, [f"http://127.0.0.1:{dead_port}/health"])
        # The silent server comes back: the group is back in rotation.
        server = http.server.ThreadingHTTPServer(("127.0.0.1", dead_port), type("H", (http.server.BaseHTTPRequestHandler,), {
            "do_GET": lambda self: (self.send_response(200), self.send_header("Content-Length", "0"), self.end_headers()),
            "log_message": lambda self, *a: None}))  # fmt: skip
        threading.Thread(target=server.serve_forever, daemon=True).start()
        time.sleep(1)
        assert ready() == (200, {"ready": True, "down": []})
        server.shutdown()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_health_watch_reports_its_own_instance_once_for_a_server_that_stopped_serving_and_never_for_one_that_never_served(
    shipped: Any, tmp_path: Path
) -> None:
    """gptoss-health-watch as shipped, with every unit's state from one systemctl call (a fake that
    prints a block per unit, as systemctl does) and the server's /health on loopback."""

    class Health(http.server.BaseHTTPRequestHandler):
        code = 200

        def do_GET(self) -> None:
            self.send_response(Health.code)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    run, state = tmp_path / "run", tmp_path / "state"
    run.mkdir()
    (run / "identity.env").write_text("GPTOSS_INSTANCE_ID=i-0abc\n")
    (tmp_path / "cluster.env").write_text(
        "GPTOSS_NODE=decode-0\nGPTOSS_CLUSTER=gptoss-8k1k\nAWS_REGION=us-east-2\nGPTOSS_UNHEALTHY_BACKOFF_S=600\nGPTOSS_UNHEALTHY_NEURON_ERRORS=5\n"
    )
    (tmp_path / "health").write_text(f"gptoss-stage.service - -\ngptoss-decode.service http://127.0.0.1:{server.server_address[1]}/health -\n")
    states = tmp_path / "states.json"
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    fake_command(bin_dir, "systemctl", f'echo "$*" >> "{calls}.systemctl"\n'
                 f'python3 -c \'import json,sys; s=json.load(open("{states}")); '
                 f'print("\\n\\n".join(s.get(u, "ActiveState=active\\nSubState=running\\nNRestarts=0") for u in sys.argv[1:] if u.endswith((".service", ".timer", ".target"))))\' "$@"\n')  # fmt: skip
    fake_command(bin_dir, "aws", f'echo "$*" >> "{calls}.aws"\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_RUN_DIR": str(run),
           "GPTOSS_STATE_DIR": str(state), "GPTOSS_HEALTH_FILE": str(tmp_path / "health"), "GPTOSS_SYSTEMCTL": str(bin_dir / "systemctl")}  # fmt: skip
    script = shipped("gptoss-health-watch")

    def watch(decode: str) -> subprocess.CompletedProcess[str]:
        states.write_text(json.dumps({"gptoss-decode.service": decode}))
        # The rendered arguments: grace 120 s, 3 intervals, budgets 2 and 3 within 6 h.
        return subprocess.run([str(script), "120", "3", "2", "3", "21600"], env=env, capture_output=True, text=True, timeout=60)

    looping = "ActiveState=activating\nSubState=auto-restart\nNRestarts=7"
    # A server that never answered on this instance: a configuration problem, not the hardware; never reported.
    Health.code = 503
    for _ in range(2):
        r = watch(looping)
        assert r.returncode == 0 and not (tmp_path / "calls.aws").exists(), r.stdout + r.stderr
    (run / "watch" / "gptoss-decode.service").write_text(str(int(time.time()) - 3600))
    assert watch(looping).returncode == 0 and not (tmp_path / "calls.aws").exists(), "a node that never served is not reported"
    # It answers once: the node has served. Then it restarts with back-off for longer than the bound: reported, once.
    Health.code = 200
    r = watch("ActiveState=active\nSubState=running\nNRestarts=0")
    assert r.returncode == 0 and "every server of decode-0 answers" in r.stdout and (state / "served-once").exists()
    assert not (run / "watch" / "gptoss-decode.service").exists(), "serving again resets the clock"
    Health.code = 503
    assert watch(looping).returncode == 0 and not (tmp_path / "calls.aws").exists(), "its first failing minute is within the bound"
    (run / "watch" / "gptoss-decode.service").write_text(str(int(time.time()) - 601))
    # While its Capacity Block ends (the collector drained the node), no replacement is asked for: none could launch.
    (run / "block-draining").write_text(f"{int(time.time()) + 1800}\n")
    assert watch(looping).returncode == 0 and not (tmp_path / "calls.aws").exists(), "held while the block ends"
    (run / "block-draining").unlink()
    r = watch(looping)
    assert r.returncode == 0 and (tmp_path / "calls.aws").exists(), r.stdout + r.stderr
    assert (tmp_path / "calls.aws").read_text().splitlines()[0].startswith("autoscaling describe-scaling-activities "), "the budget first"
    assert (tmp_path / "calls.aws").read_text().splitlines()[-1].split() == [
        "autoscaling", "set-instance-health", "--instance-id", "i-0abc", "--health-status", "Unhealthy", "--no-should-respect-grace-period"]  # fmt: skip
    assert "marked i-0abc (decode-0) unhealthy: gptoss-decode.service has been restarting with back-off for 60" in r.stdout
    assert "(7 restarts; the bound is 600s) after this node served" in r.stdout
    # Every run asked systemctl once, for all its units.
    assert all(line.split()[-2:] == ["gptoss-node-check.service", "gptoss-decode.service"] for line in (tmp_path / "calls.systemctl").read_text().splitlines())
    r = watch(looping)
    assert r.returncode == 0 and len((tmp_path / "calls.aws").read_text().splitlines()) == 2, "said once"
    server.shutdown()


def test_the_health_watch_replaces_for_hardware_causes_only_and_for_neuron_errors_that_persist(shipped: Any, tmp_path: Path) -> None:
    """A failed node check is reported only for a hardware cause (a new instance has its devices), past
    the rendered grace; a configuration cause (a new instance of the same image fails the same way) is
    said and held. Neuron errors count per collector interval and replace only after the rendered
    number of consecutive intervals at or over the bound."""
    calls = tmp_path / "calls.aws"
    bin_dir = tmp_path / "bin"
    states = tmp_path / "states.json"
    fake_command(bin_dir, "systemctl", f'python3 -c \'import json,sys; s=json.load(open("{states}")); '
                 f'print("\\n\\n".join(s.get(u, "ActiveState=active\\nSubState=running\\nNRestarts=0") for u in sys.argv[1:] if u.endswith(".service")))\' "$@"\n')  # fmt: skip
    fake_command(bin_dir, "aws", f'echo "$*" >> "{calls}"\n')
    (tmp_path / "cluster.env").write_text("GPTOSS_NODE=prefill-0\nGPTOSS_CLUSTER=gptoss-8k1k\nAWS_REGION=us-east-2\nGPTOSS_UNHEALTHY_BACKOFF_S=7200\nGPTOSS_UNHEALTHY_NEURON_ERRORS=20\n")
    (tmp_path / "health").write_text("gptoss-stage.service - -\n")
    from clusterspec.loading import load_config
    from node_render.render import render_cluster

    cfg_unit = next(text for r in render_cluster(load_config({})) for path, (text, _) in r.files.items() if path.endswith("gptoss-health-watch.service"))
    assert "ExecStart=/opt/gptoss/bin/gptoss-health-watch 120 3 2 3 21600\n" in cfg_unit, "the spec's grace, intervals and budgets, rendered"

    def node(name: str) -> tuple[Path, dict[str, str]]:
        run = tmp_path / name
        (run / "watch").mkdir(parents=True)
        (run / "identity.env").write_text("GPTOSS_INSTANCE_ID=i-0abc\n")
        return run, {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_RUN_DIR": str(run),
                     "GPTOSS_STATE_DIR": str(tmp_path / f"{name}-state"), "GPTOSS_HEALTH_FILE": str(tmp_path / "health"), "GPTOSS_SYSTEMCTL": str(bin_dir / "systemctl")}  # fmt: skip

    def watch(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(shipped("gptoss-health-watch")), "120", "3", "2", "3", "21600"], env=env, capture_output=True, text=True, timeout=60)

    states.write_text(json.dumps({"gptoss-node-check.service": "ActiveState=failed\nSubState=failed\nNRestarts=0"}))
    for cause, replaced in (("configuration: NIXL is not importable in /opt/venv", False), ("hardware: Neuron: 15 devices in /dev", True)):
        run, env = node(cause.split(":")[0])
        (run / "node-check.failed").write_text(cause + "\n")
        assert watch(env).returncode == 0 and not calls.exists(), "within the grace"
        (run / "watch" / "gptoss-node-check.service").write_text(str(int(time.time()) - 121))
        r = watch(env)
        assert r.returncode == 0 and calls.exists() is replaced, r.stdout + r.stderr
        if replaced:
            assert "marked i-0abc (prefill-0) unhealthy: gptoss-node-check.service failed: Neuron: 15 devices in /dev" in r.stdout
            calls.unlink()
        else:
            assert "not replacing prefill-0: its node check fails for a configuration cause, which a new instance would meet as well " \
                   "(NIXL is not importable in /opt/venv)" in r.stderr  # fmt: skip
            assert watch(env).stderr == "", "said once"

    states.write_text("{}")
    run, env = node("neuron")

    def interval(errors: int, at: int) -> subprocess.CompletedProcess[str]:
        (run / "neuron-errors").write_text(f"{errors}\n")
        os.utime(run / "neuron-errors", (at, at))  # the collector's write of that interval
        return watch(env)

    t = int(time.time()) - 1000
    assert interval(50, t).returncode == 0 and watch(env).returncode == 0 and not calls.exists(), "one interval, seen twice, is one"
    assert interval(50, t + 60).returncode == 0 and not calls.exists()
    assert interval(3, t + 120).returncode == 0 and not calls.exists(), "an interval under the bound resets the streak"
    for i in (180, 240):
        assert interval(20, t + i).returncode == 0 and not calls.exists()
    r = interval(25, t + 300)
    assert calls.exists() and "Neuron execution errors at or over 20 in each of the last 3 intervals (25 in the latest)" in r.stdout, r.stdout + r.stderr


class _AutoScaling(http.server.BaseHTTPRequestHandler):
    """Auto Scaling's query API on loopback for the real AWS CLI: DescribeScalingActivities answers the
    activities the test sets (AWS's XML), SetInstanceHealth is recorded."""

    activities: ClassVar[list[tuple[str, str, str]]] = []  # (StartTime, group, Description)
    marked: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        from urllib.parse import parse_qs

        form = {k: v[0] for k, v in parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode()).items()}
        ns = "http://autoscaling.amazonaws.com/doc/2011-01-01/"
        if form["Action"] == "DescribeScalingActivities":
            rows = [a for a in self.activities if form.get("AutoScalingGroupName") in (None, a[1])]
            members = "".join(f"<member><ActivityId>a-{i}</ActivityId><AutoScalingGroupName>{g}</AutoScalingGroupName><Description>{d}</Description>"
                              f"<Cause>At {t} an instance was taken out of service in response to a user health-check.</Cause><StartTime>{t}</StartTime>"
                              f"<StatusCode>Successful</StatusCode><Progress>100</Progress></member>" for i, (t, g, d) in enumerate(rows))  # fmt: skip
            body = f'<DescribeScalingActivitiesResponse xmlns="{ns}"><DescribeScalingActivitiesResult><Activities>{members}</Activities>' \
                   f"</DescribeScalingActivitiesResult><ResponseMetadata><RequestId>r</RequestId></ResponseMetadata></DescribeScalingActivitiesResponse>"  # fmt: skip
        else:
            assert form["Action"] == "SetInstanceHealth", form
            type(self).marked.append(form["InstanceId"])
            body = f'<SetInstanceHealthResponse xmlns="{ns}"><ResponseMetadata><RequestId>r</RequestId></ResponseMetadata></SetInstanceHealthResponse>'
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a: object) -> None:
        pass


def test_the_health_watch_stops_asking_for_replacements_past_the_node_and_the_fleet_budgets(shipped: Any, tmp_path: Path) -> None:
    """The real AWS CLI against Auto Scaling's API on loopback: a node whose own group, or whose cluster,
    saw its budget of terminations within the window is not marked again; it says why once. Older
    terminations and other clusters' do not count."""
    from datetime import UTC, datetime, timedelta

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AutoScaling)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bin_dir = tmp_path / "bin"
    real_aws_cli(bin_dir)
    fake_command(bin_dir, "systemctl", 'for u; do case $u in gptoss-node-check.service) printf "ActiveState=failed\\nSubState=failed\\nNRestarts=0\\n\\n";; *.service) printf "ActiveState=active\\n\\n";; esac; done\n')
    (tmp_path / "cluster.env").write_text("GPTOSS_NODE=prefill-1\nGPTOSS_CLUSTER=gptoss-8k1k\nAWS_REGION=us-east-2\nGPTOSS_UNHEALTHY_BACKOFF_S=7200\nGPTOSS_UNHEALTHY_NEURON_ERRORS=20\n")
    (tmp_path / "health").write_text("gptoss-stage.service - -\n")
    now = datetime.now(UTC)

    def at(hours_ago: float) -> str:
        return (now - timedelta(hours=hours_ago)).strftime("%Y-%m-%dT%H:%M:%S.000Z")

    def watch(name: str, activities: list[tuple[str, str, str]]) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        run = tmp_path / name
        (run / "watch").mkdir(parents=True)
        (run / "identity.env").write_text("GPTOSS_INSTANCE_ID=i-0abc\n")
        (run / "node-check.failed").write_text("hardware: Neuron: 15 devices in /dev\n")
        (run / "watch" / "gptoss-node-check.service").write_text(str(int(now.timestamp()) - 600))
        _AutoScaling.activities, _AutoScaling.marked = activities, []
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_RUN_DIR": str(run),
               "GPTOSS_STATE_DIR": str(tmp_path / f"{name}-state"), "GPTOSS_HEALTH_FILE": str(tmp_path / "health"), "GPTOSS_SYSTEMCTL": str(bin_dir / "systemctl"),
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}", "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}  # fmt: skip
        # Arguments as rendered: grace 120 s, 3 intervals, 2 per node and 3 per fleet within 6 h.
        r = subprocess.run([str(shipped("gptoss-health-watch")), "120", "3", "2", "3", "21600"], env=env, capture_output=True, text=True, timeout=120)
        return r, list(_AutoScaling.marked)

    def term(hours_ago: float, node: str, cluster: str = "gptoss-8k1k") -> tuple[str, str, str]:
        return at(hours_ago), f"{cluster}-{node}", "Terminating EC2 instance: i-0123456789abcdef0"

    launch = (at(1), "gptoss-8k1k-prefill-1", "Launching a new EC2 instance: i-0fedcba987654321f")
    try:
        # Within both budgets: one earlier replacement of this node, one of another; launches, older ones and other clusters' do not count.
        r, marked = watch("within", [term(1, "prefill-1"), term(2, "decode-3"), launch, term(7, "prefill-1"), term(7, "decode-0"),
                                     term(0.5, "prefill-1", cluster="other"), term(0.5, "decode-1", cluster="other")])  # fmt: skip
        assert r.returncode == 0 and marked == ["i-0abc"], r.stdout + r.stderr
        assert not (tmp_path / "within" / "watch" / "budget-spent").exists(), "asked, not held"
        # This node was replaced twice in the window: its budget is spent.
        r, marked = watch("node", [term(1, "prefill-1"), term(5, "prefill-1")])
        assert r.returncode == 0 and marked == [], r.stdout + r.stderr
        assert "not asking for a replacement: prefill-1 was replaced 2 times in the last 21600s (its budget is 2); this node stays as it is" in r.stderr
        # What the collector publishes as ReplacementHeld (its alarm pages), with the reason; gone once nothing is wanted.
        held = tmp_path / "node" / "watch" / "budget-spent"
        assert held.read_text().startswith("prefill-1 was replaced 2 times in the last 21600s (its budget is 2): gptoss-node-check.service failed"), held.read_text()
        (tmp_path / "node" / "node-check.failed").unlink()
        (tmp_path / "node" / "watch" / "gptoss-node-check.service").unlink()
        fake_command(bin_dir, "systemctl", 'for u; do case $u in *.service) printf "ActiveState=active\\n\\n";; esac; done\n')
        env_again = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"),
                     "GPTOSS_RUN_DIR": str(tmp_path / "node"), "GPTOSS_STATE_DIR": str(tmp_path / "node-state"),
                     "GPTOSS_HEALTH_FILE": str(tmp_path / "health"), "GPTOSS_SYSTEMCTL": str(bin_dir / "systemctl")}  # fmt: skip
        again = subprocess.run([str(shipped("gptoss-health-watch")), "120", "3", "2", "3", "21600"], env=env_again, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and not held.exists(), again.stdout + again.stderr
        fake_command(bin_dir, "systemctl", 'for u; do case $u in gptoss-node-check.service) printf "ActiveState=failed\\nSubState=failed\\nNRestarts=0\\n\\n";; *.service) printf "ActiveState=active\\n\\n";; esac; done\n')
        # Three of the cluster's nodes in the window: the fleet's budget is spent.
        r, marked = watch("fleet", [term(1, "decode-0"), term(2, "decode-1"), term(3, "prefill-0")])
        assert r.returncode == 0 and marked == [], r.stdout + r.stderr
        assert "the cluster's nodes were replaced 3 times in the last 21600s (the fleet's budget is 3)" in r.stderr
    finally:
        server.shutdown()
