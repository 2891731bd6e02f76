"""gptoss-members run for real as shipped against moto's EC2 and SSM: the fleet's members by identity tag,
/etc/hosts, a surge's name hand-over, the routers' one-at-a-time restarts, the toy proxy's group."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import boto3

from node_render.command_lines import router_fleet
from node_render.paths import router_parameter
from node_render.quoting import env_file as render_env_file
from node_render.render import cluster_env, render_cluster
from tests.conftest import fake_command, real_aws_cli, serve_health
from tests.userdata.router_fleet import CREDS, NET, PORTS, _cfg


def _members_env(tmp: Path, url: str, node: str = "decode-1", kind: str = "vllm-router") -> tuple[dict[str, str], Any]:
    """The environment of gptoss-members on `node`, and an EC2 client of the same moto."""

    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=10)
    cfg = _cfg(kind)
    values = cluster_env(cfg, next(n for n in cfg.layout.nodes if n.name == node))
    env_file = tmp / "cluster.env"
    env_file.write_text(render_env_file(values))
    bindir = tmp / "bin"
    real_aws_cli(bindir)
    fake_command(bindir, "systemctl", f'echo "$*" >> "{tmp}/systemctl.log"\n')
    env = {**os.environ, **CREDS, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "AWS_ENDPOINT_URL": url,
           "GPTOSS_CLUSTER_ENV": str(env_file), "GPTOSS_MEMBERS_ENV": str(tmp / "members.env"), "GPTOSS_HOSTS_FILE": str(tmp / "etc" / "hosts")}  # fmt: skip
    ec2 = boto3.client("ec2", endpoint_url=url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    if kind == "vllm-router":
        # The routers' settings and pool: the stack's one SSM parameter (gptoss-members copies it to the node).
        ssm = boto3.client("ssm", endpoint_url=url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
        proxy = next(p for p in cfg.layout.proxies if p.kind == "vllm-router")
        ssm.put_parameter(Name=router_parameter(cfg.cluster_name), Value=router_fleet(cfg, proxy), Type="String", Overwrite=True)
        env["GPTOSS_ROUTER_FLEET"] = str(tmp / "router-fleet")
    return env, ec2


class Ec2Fleet:
    """The fleet's instances as EC2 reports them (moto): each tagged with its identity, at an address of the test's."""

    def __init__(self, ec2: Any, cidr: str = f"{NET}.0.0/16", cluster: str = "gptoss-8k1k") -> None:
        self.ec2, self.cluster = ec2, cluster
        vpc = ec2.create_vpc(CidrBlock=cidr)["Vpc"]["VpcId"]
        self.subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=cidr)["Subnet"]["SubnetId"]
        self.ids: dict[str, str] = {}

    def launch(self, node: str, ip: str, cluster: str | None = None, group: bool = True) -> str:
        """An instance of `node` at `ip`; launched by its group (which adds aws:autoscaling:groupName), or not."""
        tags = [{"Key": "gptoss:cluster", "Value": cluster or self.cluster}, {"Key": "gptoss:node", "Value": node}]
        if group:
            tags.append({"Key": "aws:autoscaling:groupName", "Value": f"{cluster or self.cluster}-{node}"})
        i = self.ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, SubnetId=self.subnet, PrivateIpAddress=ip,
                                   TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])["Instances"][0]  # fmt: skip
        if cluster is None:
            self.ids[node] = i["InstanceId"]
        return str(i["InstanceId"])

    def replace(self, node: str, ip: str) -> None:
        """What the node's group does when its instance fails: the old one goes, one of the same identity comes."""
        self.ec2.terminate_instances(InstanceIds=[self.ids[node]])
        self.launch(node, ip)


FLEET_IPS = {"prefill-0": f"{NET}.1.1", "prefill-1": f"{NET}.1.2", "decode-0": f"{NET}.2.1", "decode-1": f"{NET}.2.2"}


def _members(shipped: Any, env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(shipped("gptoss-members")), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_members_come_from_ec2_by_identity_tag_and_only_the_hosts_block_changes(moto_url: str, tmp_path: Path, shipped: Any) -> None:
    env, ec2 = _members_env(tmp_path, moto_url)
    fleet = Ec2Fleet(ec2)
    for node, ip in FLEET_IPS.items():
        fleet.launch(node, ip)
    fleet.launch("decode-0", f"{NET}.9.9", cluster="another-cluster")  # same node name, another cluster: never a member
    # An instance someone tagged as decode-1 of this cluster, launched after it, but by no group of the
    # cluster's (its aws:autoscaling:groupName only Auto Scaling sets): never a member, newer or not.
    fleet.launch("decode-1", f"{NET}.9.10", group=False)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hosts").write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost\n")
    res = _members(shipped, env, "hosts")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = (tmp_path / "etc" / "hosts").read_text().splitlines()
    assert lines[:2] == ["127.0.0.1 localhost", "::1 localhost ip6-localhost"], "the operator's lines stay"
    assert sorted(lines[3:-1]) == sorted(f"{ip} {n}.gptoss.internal" for n, ip in FLEET_IPS.items()) and lines[-1] == "# END gptoss members"
    # Two instances of one node that Auto Scaling holds in no group (so neither stays): the newer launch wins;
    # an unchanged list rewrites nothing. (Instances of a real group: the next test.)
    fleet.launch("prefill-1", f"{NET}.1.22")
    stat = (tmp_path / "etc" / "hosts").stat()
    assert _members(shipped, env, "sync").returncode == 0
    assert f"{NET}.1.22 prefill-1.gptoss.internal" in (tmp_path / "etc" / "hosts").read_text()
    assert (tmp_path / "etc" / "hosts").stat().st_ino != stat.st_ino, "replaced whole (by rename), never half-written"
    again = (tmp_path / "etc" / "hosts").stat()
    assert _members(shipped, env, "sync").returncode == 0
    assert (tmp_path / "etc" / "hosts").stat().st_ino == again.st_ino, "nothing changed: nothing written"
    assert not (tmp_path / "systemctl.log").exists(), "a router follows names: nothing restarts"


def test_a_surge_replacement_takes_its_nodes_name_only_when_its_group_lets_the_old_instance_go(
    moto_url: str, tmp_path: Path, shipped: Any
) -> None:
    """A surge (rollout.surge): prefill-1's group (moto's Auto Scaling) grows to two; the new instance
    runs but does not serve yet, so the name stays with the old one; when the group takes the old one
    out of service (here Standby: any state but InService or Pending* is leaving, as Terminating:Wait
    is while the drain hook holds it), the next sync moves the name to the new one."""
    env, ec2 = _members_env(tmp_path, moto_url)
    autoscaling = boto3.client("autoscaling", endpoint_url=moto_url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    fleet = Ec2Fleet(ec2)
    for node, ip in FLEET_IPS.items():
        if node != "prefill-1":
            fleet.launch(node, ip)
    ec2.create_launch_template(LaunchTemplateName="prefill-1", LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "t3.micro"})
    group = "gptoss-8k1k-prefill-1"
    tags = [{"Key": k, "Value": v, "PropagateAtLaunch": True, "ResourceId": group, "ResourceType": "auto-scaling-group"}
            for k, v in (("gptoss:cluster", "gptoss-8k1k"), ("gptoss:node", "prefill-1"))]  # fmt: skip
    autoscaling.create_auto_scaling_group(AutoScalingGroupName=group, MinSize=1, MaxSize=2, DesiredCapacity=1, Tags=tags,
                                          LaunchTemplate={"LaunchTemplateName": "prefill-1"}, VPCZoneIdentifier=fleet.subnet)  # fmt: skip

    def instances() -> list[dict[str, Any]]:
        found = ec2.describe_instances(Filters=[{"Name": "tag:aws:autoscaling:groupName", "Values": [group]}])
        return sorted((i for r in found["Reservations"] for i in r["Instances"]), key=lambda i: i["LaunchTime"])

    (old,) = instances()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hosts").write_text("127.0.0.1 localhost\n")

    def named() -> str:
        res = _members(shipped, env, "sync")
        assert res.returncode == 0, res.stdout + res.stderr
        line = next(x for x in (tmp_path / "etc" / "hosts").read_text().splitlines() if x.endswith(" prefill-1.gptoss.internal"))
        return line.split()[0]

    assert named() == old["PrivateIpAddress"]
    time.sleep(1.1)  # a later LaunchTime (EC2 reports seconds)
    autoscaling.set_desired_capacity(AutoScalingGroupName=group, DesiredCapacity=2)
    new = next(i for i in instances() if i["InstanceId"] != old["InstanceId"])
    assert new["LaunchTime"] > old["LaunchTime"] and new["PrivateIpAddress"] != old["PrivateIpAddress"]
    assert named() == old["PrivateIpAddress"], "a replacement that does not serve yet never takes the name"
    autoscaling.enter_standby(AutoScalingGroupName=group, InstanceIds=[old["InstanceId"]], ShouldDecrementDesiredCapacity=True)
    assert named() == new["PrivateIpAddress"], "the group let the old instance go: the name moves to its replacement"
    # Every other member kept its address throughout.
    hosts = (tmp_path / "etc" / "hosts").read_text()
    assert all(f"{ip} {n}.gptoss.internal" in hosts for n, ip in FLEET_IPS.items() if n != "prefill-1"), hosts


def test_a_new_router_setting_or_member_restarts_the_routers_one_node_at_a_time(moto_url: str, tmp_path: Path, shipped: Any) -> None:
    """The fleet's router document (the stack's SSM parameter) changes: each router node's members sync
    copies it and restarts its router only once the router before it (decode-<i-1>) serves the new
    document (its API gate's /readiness: 200 and X-Gptoss-Fleet, the document's sha256); decode-0 goes
    first; the roll stops at a router that does not come back; an unchanged document restarts nothing."""
    env, ec2 = _members_env(tmp_path, moto_url)  # decode-1: index 1
    ssm = boto3.client("ssm", endpoint_url=moto_url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    fleet = Ec2Fleet(ec2)
    for node, ip in FLEET_IPS.items():
        fleet.launch(node, ip)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    env |= {"GPTOSS_RUN_DIR": str(tmp_path), "GPTOSS_SYSTEMCTL": str(tmp_path / "bin" / "systemctl")}
    doc = tmp_path / "router-fleet"
    res = _members(shipped, env, "hosts")
    assert res.returncode == 0 and "the fleet's router settings and pool" in res.stdout, res.stdout + res.stderr
    assert doc.read_text() == router_fleet(_cfg("vllm-router"), _cfg("vllm-router").layout.proxies[0])
    # The router starts with it (gptoss-router-pool keeps a copy of what it started with).
    subprocess.run([str(shipped("gptoss-router-pool")), str(doc), "--", "true"], check=True, timeout=30)
    assert _members(shipped, env, "sync").returncode == 0 and not (tmp_path / "systemctl.log").exists(), "nothing changed: nothing restarts"
    changed = doc.read_text().replace("arg --health-check-timeout-secs\narg 10\n", "arg --health-check-timeout-secs\narg 12\n")
    assert changed != doc.read_text()
    want = hashlib.sha256(changed.encode()).hexdigest()
    ssm.put_parameter(Name="/gptoss/gptoss-8k1k/router", Value=changed, Type="String", Overwrite=True)
    res = _members(shipped, env, "sync")
    assert res.returncode == 0 and "this node's router restarts once decode-0 serves them (its readiness now: no answer; at most 1950s)" in res.stdout, res.stdout
    assert doc.read_text() == changed and not (tmp_path / "systemctl.log").exists(), "decode-0 has not restarted yet"
    # decode-0's API gate (at its address in the hosts block), as its readiness answers while its router rolls.
    answer = {"status": 200, "fleet": "0" * 64}

    class Readiness(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(answer["status"] if self.path == "/readiness" else 404)
            self.send_header("X-Gptoss-Fleet", str(answer["fleet"]))
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    predecessor = http.server.ThreadingHTTPServer((FLEET_IPS["decode-0"], PORTS["serving.proxy.port"]), Readiness)
    threading.Thread(target=predecessor.serve_forever, daemon=True).start()
    try:
        res = _members(shipped, env, "sync")  # decode-0 still runs the old document
        assert f"(its readiness now: 200 {'0' * 64}; at most 1950s)" in res.stdout and not (tmp_path / "systemctl.log").exists(), res.stdout
        assert _members(shipped, env, "sync").stdout == "", "said once, not at every poll"
        answer.update(status=503, fleet=want)  # restarted with it, not ready yet
        res = _members(shipped, env, "sync")
        assert f"(its readiness now: 503 {want}" in res.stdout and not (tmp_path / "systemctl.log").exists(), res.stdout
        answer.update(status=200)
        res = _members(shipped, env, "sync")
        assert "restarting this node's router with the fleet's new settings and pool (decode-0 serves them); it goes lame-duck first" in res.stdout, res.stdout
        assert (tmp_path / "systemctl.log").read_text() == "--no-block try-restart gptoss-proxy.service\n"
        # Once restarted (gptoss-router-pool copies the new document), nothing is due any more.
        subprocess.run([str(shipped("gptoss-router-pool")), str(doc), "--", "true"], check=True, timeout=30)
        assert _members(shipped, env, "sync").returncode == 0 and (tmp_path / "systemctl.log").read_text().count("try-restart") == 1
        # A router that does not come back stops the roll: this node waits the document's restart_gap, then says so once and keeps its router.
        again = changed + "pool decode 9 9 8200 8200\n"
        ssm.put_parameter(Name="/gptoss/gptoss-8k1k/router", Value=again, Type="String", Overwrite=True)
        assert "restarts once decode-0 serves them" in _members(shipped, env, "sync").stdout
        since = tmp_path / "router-roll-since"
        since.write_text(f"{int(time.time()) - 1951} {hashlib.sha256(again.encode()).hexdigest()}\n")
        res = _members(shipped, env, "sync")
        assert (f"the roll stops here: decode-0 has not served the fleet's new router settings and pool within 1950s of this node seeing them "
                f"(its readiness: 200 {want}); this node's router keeps the settings it has until decode-0 serves") in res.stdout, res.stdout  # fmt: skip
        assert _members(shipped, env, "sync").stdout == "" and (tmp_path / "systemctl.log").read_text().count("try-restart") == 1
    finally:
        predecessor.shutdown()
        predecessor.server_close()
    # decode-0 (index 0) restarts at the first sync that sees a change.
    env0 = env | {"GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster0.env")}
    (tmp_path / "cluster0.env").write_text(Path(env["GPTOSS_CLUSTER_ENV"]).read_text().replace("GPTOSS_NODE=decode-1", "GPTOSS_NODE=decode-0"))
    res = _members(shipped, env0, "sync")
    assert "restarting this node's router with the fleet's new settings and pool; it goes lame-duck first" in res.stdout, res.stdout
    assert (tmp_path / "systemctl.log").read_text().count("try-restart") == 2
    # A document of a newer form than this node's reader knows (one a later release writes): refused by name before
    # it is copied, on decode-0 too, so no router restarts on it and each keeps what it runs.
    subprocess.run([str(shipped("gptoss-router-pool")), str(doc), "--", "true"], check=True, timeout=30)
    kept = doc.read_text()
    ssm.put_parameter(Name="/gptoss/gptoss-8k1k/router", Value="version 2\n" + kept, Type="String", Overwrite=True)
    res = _members(shipped, env0, "sync")
    assert res.returncode != 0, res.stdout + res.stderr
    assert "gptoss-members: error: /gptoss/gptoss-8k1k/router is a version 2 document; this node reads up to version 1: " in res.stderr
    assert res.stderr.rstrip().endswith(f"; the router keeps {doc}"), res.stderr
    assert doc.read_text() == kept and (tmp_path / "systemctl.log").read_text().count("try-restart") == 2, "nothing copied, nothing restarted"


def test_the_toy_proxys_members_wait_for_its_group_and_restart_it_when_one_is_replaced(moto_url: str, tmp_path: Path, shipped: Any) -> None:
    env, ec2 = _members_env(tmp_path, moto_url, node="decode-1", kind="toy")
    # The node's gptoss-group-health unit, as rendered: the group's health routes a replaced member must answer.
    (render,) = [r for r in render_cluster(_cfg("toy")) if r.node.name == "decode-1"]
    unit = tmp_path / "gptoss-group-health.service"
    unit.write_text(render.files["/etc/systemd/system/gptoss-group-health.service"][0])
    env["GPTOSS_GROUP_HEALTH_UNIT"] = str(unit)
    fleet = Ec2Fleet(ec2)
    fleet.launch("decode-1", FLEET_IPS["decode-1"])
    fleet.launch("prefill-0", FLEET_IPS["prefill-0"])  # another group's: never waited for
    # The timer's first sync can run before the proxy's start wrote the file: it restarts nothing.
    res = _members(shipped, env, "sync")
    assert res.returncode == 0 and "is not written yet" in res.stdout and not (tmp_path / "systemctl.log").exists(), res.stdout + res.stderr
    assert not (tmp_path / "members.env").exists()
    # The proxy's start waits for its group (prefill-1 holds decode-1's replicas); it appears while the script asks.
    proc = subprocess.Popen([str(shipped("gptoss-members")), "write"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "waiting for the members prefill-1 to run" in first, first
    fleet.launch("prefill-1", FLEET_IPS["prefill-1"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, first + out + err
    assert (tmp_path / "members.env").read_text().splitlines() == [f"GPTOSS_HOST_DECODE_1={NET}.2.2", f"GPTOSS_HOST_PREFILL_1={NET}.1.2"]
    res = _members(shipped, env, "sync")
    assert res.returncode == 0 and not (tmp_path / "systemctl.log").exists(), res.stdout + res.stderr
    fleet.replace("prefill-1", f"{NET}.1.99")
    # Launched, not serving yet (staging, compiling): the proxy keeps serving with the members it has.
    res = _members(shipped, env, "sync")
    silent = " ".join(f"http://{NET}.1.99:{port}/health" for port in (28100, 28101, 28102))  # prefill-1's three replicas of decode-1's group
    assert res.returncode == 0 and f"a member's address changed (GPTOSS_HOST_PREFILL_1={NET}.1.99); the proxy restarts once its servers answer there (not yet: {silent})" in res.stdout, res.stdout + res.stderr
    assert f"GPTOSS_HOST_PREFILL_1={NET}.1.2" in (tmp_path / "members.env").read_text() and not (tmp_path / "systemctl.log").exists()
    res = _members(shipped, env, "sync")  # the next poll, nothing new: said once, not at every poll
    assert res.returncode == 0 and res.stdout == "" and not (tmp_path / "systemctl.log").exists(), res.stdout + res.stderr
    # Two of its three replicas answer: still not.
    servers = [serve_health(f"{NET}.1.99", port) for port in (28100, 28101)]
    res = _members(shipped, env, "sync")
    assert f"(not yet: http://{NET}.1.99:28102/health)" in res.stdout and not (tmp_path / "systemctl.log").exists(), res.stdout + res.stderr
    servers.append(serve_health(f"{NET}.1.99", 28102))
    res = _members(shipped, env, "sync")
    for server in servers:
        server.shutdown()
        server.server_close()
    assert res.returncode == 0 and "a member's address changed and its servers answer there" in res.stdout, res.stdout + res.stderr
    assert f"GPTOSS_HOST_PREFILL_1={NET}.1.99" in (tmp_path / "members.env").read_text()
    assert (tmp_path / "systemctl.log").read_text() == "try-restart gptoss-proxy.service gptoss-group-health.service\n"
    # A member gone (its group replacing it): the proxy keeps the addresses it has, nothing restarts.
    ec2.terminate_instances(InstanceIds=[fleet.ids["prefill-1"]])
    res = _members(shipped, env, "sync")
    assert res.returncode == 0 and "not running now: prefill-1" in res.stdout, res.stdout
    assert (tmp_path / "systemctl.log").read_text().count("try-restart") == 1


def test_a_member_that_never_runs_fails_the_wait_by_name(moto_url: str, tmp_path: Path, shipped: Any) -> None:
    env, ec2 = _members_env(tmp_path, moto_url, node="decode-1", kind="toy")
    Ec2Fleet(ec2).launch("prefill-0", FLEET_IPS["prefill-0"])
    res = _members(shipped, env | {"GPTOSS_MEMBERS_TIMEOUT_S": "3"}, "write")
    assert res.returncode == 1
    assert "no running instance of decode-1 prefill-1 in gptoss-8k1k within 3s; giving up" in res.stderr, res.stderr  # prefill-0 is not its group
    assert not (tmp_path / "members.env").exists()
