"""CloudFormation's stack update, replayed from its documentation on synthesized templates.

moto runs no rolling update (it replaces a changed Auto Scaling group or nested stack at once,
ignores UpdatePolicy and DependsOn timing), so the rollout's order, its clocks and its rollback
are replayed here from the rules AWS documents, each cited where it is encoded. The model reads
the synthesized templates only (the stack and its cells, flattened by cluster_ops.rollout), never
the rollout's own computation; a node's signalling decision is the shipped `gptoss-signal` itself,
run on a fake clock (SignalRun) against fakes of the S3 handle and the AWS CLI it calls.

What the model assumes beyond the pages it cites (each said where it is used):
- CloudFormation's own steps take no time: a handle, a launch template version, an alarm is made
  the moment its dependencies are done. Only instances take time: a node serves `serve_s` after
  its instance launches (its role's node time), or its new version fails at that time.
- A rollback re-applies the previous launch template data as a new version (a launch template
  update makes a new version), so every instance of a rolled-back group runs a version other
  than the group's and is replaced by the previous template's user data.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import json
import re
import subprocess
import sys
import tempfile
import time as real_time
import types
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_render.quoting import parse_env_file
from node_render.userdata import NODES_PREFIX, parse_user_data, unbundle

# The software assets of the assemblies replayed here, by sha256 (what S3 holds at the key a version
# names): a node's instance reads its version's files there, as gptoss-fetch-scripts does.
SOFTWARE: dict[str, bytes] = {}


def register_assembly(assembly: Path) -> None:
    """Hold the software asset(s) a synthesized assembly staged, as the deploy would upload them."""
    import hashlib

    for path in assembly.glob("asset.*.xz"):
        data = path.read_bytes()
        SOFTWARE[hashlib.sha256(data).hexdigest()] = data


# What a node reads of a version: unpacked once per version and node (a replay of 56 nodes reads the
# same asset hundreds of times; each unpacking is a whole fleet's files).
_UNPACKED: dict[str, dict[str, tuple[str, int]]] = {}
_NODE_ENV: dict[tuple[str, str], dict[str, str]] = {}
# The node a launch template's user data names (its text with the deploy-time tokens blanked).
_NODE_OF: dict[str, str] = {}


def version_env(sha: str, node: str) -> dict[str, str]:
    """A node's cluster.env as the software version SHA holds it (the asset is content-addressed: it never changes)."""
    if (sha, node) not in _NODE_ENV:
        if sha not in _UNPACKED:
            _UNPACKED[sha] = unbundle(SOFTWARE[sha])
        _NODE_ENV[sha, node] = parse_env_file(_UNPACKED[sha][f"/{NODES_PREFIX}/{node}/etc/gptoss/cluster.env"][0])
    return dict(_NODE_ENV[sha, node])

ROOT = Path(__file__).resolve().parent.parent.parent
SIGNAL_SCRIPT = ROOT / "userdata" / "bin" / "gptoss-signal"

# The pages each rule encodes.
DEPENDS_ON = "https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-attribute-dependson.html"
UPDATE_POLICY = "https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-attribute-updatepolicy.html"
WAIT_CONDITION = "https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-resource-cloudformation-waitcondition.html"
WAIT_CONDITIONS_GUIDE = "https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/using-cfn-waitcondition.html"
LAUNCH_TEMPLATE = "https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-resource-ec2-launchtemplate.html"
NESTED_STACKS = "https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/using-cfn-nested-stacks.html"
ROLLBACK_FAILED = "https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/troubleshooting.html#troubleshooting-errors-update-rollback-failed"
LIFECYCLE_HOOKS = "https://docs.aws.amazon.com/autoscaling/ec2/userguide/lifecycle-hooks.html"
CLOUDWATCH_QUOTAS = "https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/cloudwatch_limits.html"

# WAIT_CONDITIONS_GUIDE: the presigned URL of a wait condition handle is valid for 24 hours
# (not configurable: aws-cloudformation roadmap issue 1842).
HANDLE_URL_S = 24 * 3600
# UPDATE_POLICY: PauseTime is at most one hour.
PAUSE_MAX_S = 3600
# CLOUDWATCH_QUOTAS: PutMetricAlarm, 3 transactions per second per Region. The model gives each
# call one second: CloudFormation issues as many as it has alarms with nothing left to wait for.
PUT_METRIC_ALARM_TPS = 3
ALARM_S = 1.0

Template = dict[str, Any]
Resources = dict[str, Any]


def refs(value: Any) -> set[str]:
    """Every logical id a value refers to (Ref, Fn::GetAtt, Fn::Sub's ${Name}); pseudo parameters aside."""
    out: set[str] = set()
    if isinstance(value, dict):
        if set(value) == {"Ref"} and isinstance(value["Ref"], str):
            out.add(value["Ref"])
        elif set(value) == {"Fn::GetAtt"}:
            target = value["Fn::GetAtt"]
            out.add(target[0] if isinstance(target, list) else str(target).split(".")[0])
        elif set(value) == {"Fn::Sub"}:
            text = value["Fn::Sub"][0] if isinstance(value["Fn::Sub"], list) else value["Fn::Sub"]
            out |= {n.split(".")[0] for n in re.findall(r"\$\{([^}!]+)\}", text)}
            if isinstance(value["Fn::Sub"], list):
                out |= refs(value["Fn::Sub"][1])
        else:
            for v in value.values():
                out |= refs(v)
    elif isinstance(value, list):
        for v in value:
            out |= refs(v)
    return {r for r in out if not r.startswith("AWS::")}


def getatts(value: Any) -> set[str]:
    """The logical ids a value reads an attribute of (Fn::GetAtt): a changed target changes the value."""
    out: set[str] = set()
    if isinstance(value, dict):
        if set(value) == {"Fn::GetAtt"}:
            target = value["Fn::GetAtt"]
            out.add(target[0] if isinstance(target, list) else str(target).split(".")[0])
        for v in value.values():
            out |= getatts(v)
    elif isinstance(value, list):
        for v in value:
            out |= getatts(v)
    return out


def _depends(res: Mapping[str, Any]) -> list[str]:
    d = res.get("DependsOn", [])
    return [d] if isinstance(d, str) else list(d)


def scope_of(lid: str) -> str:
    """The cell (nested stack) a flattened logical id is in, '' for the parent."""
    return lid.rpartition("/")[0]


def _seconds(iso: str) -> int:
    """An ISO 8601 duration (PT#H#M#S) in seconds."""
    m = re.fullmatch(r"PT(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?", iso)
    if not m:
        raise ValueError(f"not an ISO 8601 duration: {iso}")
    h, mi, s = (int(x or 0) for x in m.groups())
    return h * 3600 + mi * 60 + s


class Stack:
    """The flattened resources of one template set (the stack and its cells) and their dependencies."""

    def __init__(self, resources: Resources) -> None:
        self.res = {k: v for k, v in resources.items() if v.get("Type") != "AWS::CDK::Metadata"}
        self._deps: dict[str, set[str]] = {}

    def deps(self, lid: str) -> set[str]:
        """DEPENDS_ON: what must be done before LID is created or updated: its DependsOn and what it refers to, in its own template."""
        if lid not in self._deps:
            scope = scope_of(lid)
            res = self.res[lid]
            names = set(_depends(res)) | refs(res.get("Properties", {}))
            full = {f"{scope}/{n}" if scope else n for n in names}
            self._deps[lid] = {f for f in full if f in self.res and f != lid}
        return self._deps[lid]

    def node_of(self, lid: str) -> str | None:
        tags = {t.get("Key"): t.get("Value") for t in self.res[lid].get("Properties", {}).get("Tags", []) if isinstance(t, dict)}
        node = tags.get("gptoss:node")
        return node if isinstance(node, str) else None

    def launch_template_of(self, group: str) -> str | None:
        ref = (self.res[group].get("Properties", {}).get("LaunchTemplate") or {}).get("LaunchTemplateId") or {}
        name = ref.get("Ref") if isinstance(ref, dict) else None
        scope = scope_of(group)
        return (f"{scope}/{name}" if scope else name) if name else None

    def handle_of(self, template: str) -> str | None:
        """The wait condition handle whose URL a launch template's user data carries."""
        scope = scope_of(template)
        for name in refs(self.res[template].get("Properties", {})):
            full = f"{scope}/{name}" if scope else name
            if self.res.get(full, {}).get("Type") == "AWS::CloudFormation::WaitConditionHandle":
                return full
        return None

    def node_env(self, template: str) -> dict[str, str]:
        """The node's cluster.env, from the software version its instance boots with: the one the stack's
        software parameter names (in either rollout.software mode)."""
        data = self.res[template]["Properties"]["LaunchTemplateData"]["UserData"]
        join = data["Fn::Base64"]
        parts = join["Fn::Join"][1] if isinstance(join, dict) else [join]
        text = "".join(p if isinstance(p, str) else "TOKEN" for p in parts)
        if text not in _NODE_OF:
            _NODE_OF[text] = parse_user_data(text)[1]["GPTOSS_NODE"]
        return version_env(self.software_version(), _NODE_OF[text])

    def software_version(self) -> str:
        """The sha256 the stack's software parameter names (its value: the asset's URI, then the sha256)."""
        (value,) = [r["Properties"]["Value"] for r in self.res.values()
                    if r.get("Type") == "AWS::SSM::Parameter" and str(r["Properties"].get("Name", "")).endswith("/software")]  # fmt: skip
        return str(value["Fn::Join"][1][-1])


def _launch_props(res: Mapping[str, Any]) -> Any:
    """What CloudFormation compares to decide a resource is updated: its type, properties and policies."""
    return {k: res.get(k) for k in ("Type", "Properties", "UpdatePolicy", "CreationPolicy")}


def changes(before: Stack, after: Stack) -> dict[str, str]:
    """Each resource of AFTER: 'new', 'changed' or 'same'. A resource is changed when its own text
    changed, or when it reads an attribute (Fn::GetAtt) of a new or changed one: a group reads its
    launch template's LatestVersionNumber, which a new template version changes (LAUNCH_TEMPLATE)."""
    out = {}
    for lid, res in after.res.items():
        if lid not in before.res:
            out[lid] = "new"
        elif _launch_props(before.res[lid]) != _launch_props(res):
            out[lid] = "changed"
        else:
            out[lid] = "same"
    moved = True
    while moved:
        moved = False
        for lid, state in out.items():
            if state != "same":
                continue
            scope = scope_of(lid)
            targets = {f"{scope}/{n}" if scope else n for n in getatts(after.res[lid].get("Properties", {}))}
            if any(out.get(t) in ("new", "changed") for t in targets):
                out[lid] = "changed"
                moved = True
    # A cell whose template changed is updated (its TemplateURL names the new template's hash).
    for lid in list(out):
        cell = after.res[lid].get("Type") == "AWS::CloudFormation::Stack" and out[lid] == "same"
        if cell and (any(out[c] != "same" for c in after.res if scope_of(c) == lid) or any(scope_of(c) == lid and c not in after.res for c in before.res)):
            out[lid] = "changed"
    return out


# ---- a node's own signal: the shipped gptoss-signal on a fake clock ----------------------------------------


@dataclass
class Action:
    """What a node's gptoss-signal did, when (fake epoch seconds)."""

    at: float
    kind: str  # "handle": a PUT to the deploy gate's URL; "group": SignalResource to its group
    status: str  # SUCCESS or FAILURE
    reason: str = ""


class _Clock:
    """The script's `time`: a fake now that its sleeps advance; everything else is the real module."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += max(s, 0.001)

    def __getattr__(self, name: str) -> Any:
        return getattr(real_time, name)


_SIGNAL_CODE = compile(SIGNAL_SCRIPT.read_text(), str(SIGNAL_SCRIPT), "exec")
# The module it imports from its own folder (on a node, the folder Python runs it from is first on its path).
if str(SIGNAL_SCRIPT.parent) not in sys.path:
    sys.path.append(str(SIGNAL_SCRIPT.parent))
EXPIRED_XML = b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"


def handle_url(made_at: float, region: str = "us-east-2") -> str:
    """A wait condition handle's presigned URL as CloudFormation makes it (SigV4, valid 24 hours), signed at MADE_AT."""
    stamp = real_time.strftime("%Y%m%dT%H%M%SZ", real_time.gmtime(made_at))
    return (f"https://cloudformation-waitcondition-{region}.s3.amazonaws.com/arn%3Aaws%3Acloudformation%3A{region}%3A123456789012"
            f"%3Astack/cell/handle?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Date={stamp}&X-Amz-SignedHeaders=host"
            f"&X-Amz-Expires={HANDLE_URL_S - 1}&X-Amz-Credential=AKIAEXAMPLE%2F20261204%2F{region}%2Fs3%2Faws4_request"
            f"&X-Amz-Signature={'0' * 64}")  # fmt: skip


def run_signal(
    *,
    env: Mapping[str, str],
    url: str,
    launched: float,
    verdict_at: float,
    verdict: str,
    instance: str,
    stack: str,
    group: str,
    gate: str | None = None,
    gate_answered: bool = False,
) -> tuple[list[Action], str]:
    """Run the shipped gptoss-signal for one instance, from its launch until it exits, on a fake clock.

    Its units report "not ready" until VERDICT_AT, then VERDICT ('success' or 'failure'); S3
    answers a PUT to the handle's URL like a presigned URL (403 "Request has expired" after its
    X-Amz-Expires); the AWS CLI answers describe-tags with the tags CloudFormation puts on a
    group's instances, signal-resource with success (what it does to the update is the model's),
    describe-stack-resource with the gate's state (GATE_ANSWERED). Returns its actions and output.
    """
    actions: list[Action] = []
    clock = _Clock(launched)
    with tempfile.TemporaryDirectory(prefix="replay-node-") as tmp:
        d = Path(tmp)
        for sub in ("etc", "state", "run"):
            (d / sub).mkdir()
        (d / "etc" / "cluster.env").write_text("".join(f"{k}={v}\n" for k, v in env.items() if v != "" and " " not in v))
        (d / "etc" / "signal.env").write_text(f"GPTOSS_SIGNAL_URL={url}\n" + (f"GPTOSS_GATE={gate}\n" if gate else ""))
        (d / "etc" / "health").write_text("gptoss-node.target - -\n")
        (d / "run" / "identity.env").write_text(f"GPTOSS_INSTANCE_ID={instance}\n")
        (d / "stat").write_text(f"cpu 0 0 0 0\nbtime {int(launched)}\n")

        def urlopen(req: Any, timeout: float = 0) -> Any:
            q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(req.full_url).query))
            signed = float(real_time.mktime(real_time.strptime(q["X-Amz-Date"], "%Y%m%dT%H%M%SZ")) - real_time.timezone)
            if clock.now >= signed + float(q["X-Amz-Expires"]):
                raise urllib.error.HTTPError(req.full_url, 403, "Forbidden", {}, io.BytesIO(EXPIRED_XML))  # type: ignore[arg-type]
            doc = json.loads(req.data)
            actions.append(Action(clock.now, "handle", doc["Status"], doc.get("Reason", "")))
            return contextlib.nullcontext()

        def run(cmd: list[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
            args = list(cmd)
            if args[:1] != ["aws"]:
                return subprocess.CompletedProcess(args, 1, "", "not on this node")
            if args[1:3] == ["ec2", "describe-tags"]:
                out = f"aws:cloudformation:logical-id\t{group}\naws:cloudformation:stack-name\t{stack}\n"
                return subprocess.CompletedProcess(args, 0, out, "")
            if args[1:3] == ["cloudformation", "signal-resource"]:
                status = args[args.index("--status") + 1]
                actions.append(Action(clock.now, "group", status))
                return subprocess.CompletedProcess(args, 0, "", "")
            if args[1:3] == ["cloudformation", "describe-stack-resource"]:
                state = "CREATE_COMPLETE" if gate_answered else "CREATE_IN_PROGRESS"
                out = state if "--query" in args else json.dumps({"StackResourceDetail": {"ResourceStatus": state}})
                return subprocess.CompletedProcess(args, 0, out, "")
            return subprocess.CompletedProcess(args, 254, "", f"unexpected call: {' '.join(args[:3])}")

        def check(*_a: Any, **_kw: Any) -> tuple[str, str]:
            if clock.now < verdict_at:
                return "wait", "not ready: gptoss-node.target"
            return (verdict, "every unit ready" if verdict == "success" else "gptoss-decode.service failed: it cannot serve")

        ns: dict[str, Any] = {"__name__": "gptoss_signal_replayed", "__file__": str(SIGNAL_SCRIPT)}
        exec(_SIGNAL_CODE, ns)
        ns.update(
            ETC=d / "etc", STATE=d / "state", RUN=d / "run", PROC_STAT=d / "stat", time=clock, check=check, POLL_S=60.0,
            urllib=types.SimpleNamespace(request=types.SimpleNamespace(urlopen=urlopen, Request=urllib.request.Request),
                                         error=urllib.error, parse=urllib.parse),
            subprocess=types.SimpleNamespace(run=run, TimeoutExpired=subprocess.TimeoutExpired, CompletedProcess=subprocess.CompletedProcess),
        )  # fmt: skip
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            ns["main"]()
    return actions, out.getvalue()


# ---- the update ---------------------------------------------------------------------------------------------


@dataclass
class Instance:
    """One instance a group launched."""

    id: str
    node: str
    role: str
    group: str
    version: str  # "new" (this update's template) or "previous" (a rollback's)
    launched: float
    serves_at: float | None  # None: this version never serves
    ended: float | None = None  # terminated (its drain, if any, runs until drained)
    drained: float | None = None


@dataclass
class NodeTimes:
    """How long a node takes from its instance's launch to serving, per role (seconds), and which nodes' new version fails."""

    serve_s: dict[str, float]
    fails: frozenset[str] = frozenset()
    rollback_serve_s: dict[str, float] | None = None  # the previous version's time (default: serve_s)


@dataclass
class Outcome:
    """What a replayed update did."""

    state: str  # UPDATE_COMPLETE, UPDATE_ROLLBACK_COMPLETE, UPDATE_ROLLBACK_FAILED
    ended: float
    failed_at: float | None
    reasons: list[str] = field(default_factory=list)  # why resources failed, in order
    turns: dict[str, float] = field(default_factory=dict)  # node -> when its group's update started (forward)
    rollback_turns: dict[str, float] = field(default_factory=dict)  # node -> when its group's rollback started
    served: dict[str, float] = field(default_factory=dict)  # node -> when its new instance first served
    late: list[str] = field(default_factory=list)  # nodes that failed for a deadline they could have met
    instances: list[Instance] = field(default_factory=list)
    alarms_at_once: int = 0
    outputs: dict[str, str] = field(default_factory=dict)  # instance id -> gptoss-signal's output

    def batches(self, role: str, roles: Mapping[str, str]) -> list[list[str]]:
        """The forward batches of a role: the nodes whose update started at each distinct time, in order."""
        starts: dict[float, list[str]] = {}
        for node, t in self.turns.items():
            if roles.get(node) == role:
                starts.setdefault(round(t, 3), []).append(node)
        return [sorted(starts[t], key=lambda n: int(n.rpartition("-")[2])) for t in sorted(starts)]

    def min_serving(self, role: str, nodes: list[str], since: float, until: float) -> int:
        """The fewest of a role's NODES that had an instance serving at any moment between SINCE and UNTIL."""
        times = sorted({since, until} | {t for i in self.instances for t in (i.serves_at, i.ended, i.drained) if t is not None and since <= t <= until})
        fewest = len(nodes)
        for t in times:
            serving = {i.node for i in self.instances if i.node in nodes and i.serves_at is not None and i.serves_at <= t
                       and (i.drained if i.drained is not None else (i.ended if i.ended is not None else float("inf"))) > t}  # fmt: skip
            fewest = min(fewest, len(serving))
        return fewest


class Replay:
    """One stack update from BEFORE to AFTER, replayed by CloudFormation's documented rules.

    `handles_made_at`: when the handles of the running template were made (seconds before the
    update starts, negative): a rollback's node boots the previous user data, whose handle URL is
    that old. `stack_name`: the cell stack name the instances' tags carry (any string).
    """

    def __init__(
        self,
        before: Resources,
        after: Resources,
        times: NodeTimes,
        *,
        handles_made_at: float = -48 * 3600,
        epoch: float = 1_800_000_000.0,
        drain_s: float = 90,
    ) -> None:
        self.before, self.after = Stack(before), Stack(after)
        self.times = times
        self.epoch = epoch
        self.drain_s = drain_s
        self.change = changes(self.before, self.after)
        self.handles: dict[str, float] = {}  # handle lid -> when made (relative seconds)
        for lid, res in self.before.res.items():
            if res.get("Type") == "AWS::CloudFormation::WaitConditionHandle":
                self.handles[lid] = handles_made_at
        self.handle_signals: dict[str, list[tuple[float, str]]] = {}
        self.version: dict[str, tuple[str, str]] = {}  # launch template -> (which template set, its lid there)
        self.state: dict[str, str] = {}  # lid -> pending, running, done, failed (forward)
        self.rb: dict[str, str] = {}  # lid -> pending, running, done (rollback)
        self.queue: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        self.now = 0.0
        self.instances: dict[str, list[Instance]] = {}  # group -> its instances, oldest first
        self.waiting: dict[str, tuple[str, float, str]] = {}  # group -> (instance id it waits for, until, phase)
        self.min_success: dict[str, int] = {}  # group -> its policy's MinSuccessfulInstancesPercent
        self.failed_at: float | None = None
        self.rollback_failed = False
        self.outcome = Outcome("", 0, None)
        self.phase = "forward"
        self._ids = 0
        self._in_flight = 0  # PutMetricAlarm calls under way
        self._alarms_at_once = 0
        for lid, res in self.before.res.items():
            if res.get("Type") == "AWS::AutoScaling::AutoScalingGroup" and lid in self.after.res:
                # The running fleet: one instance per group, serving since long before the update.
                node = self.before.node_of(lid) or lid
                self.instances[lid] = [self._instance(node, lid, "previous", -10 * 86400, -10 * 86400 + 1)]

    # ---- mechanics

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (t, self.seq, fn))

    def _instance(self, node: str, group: str, version: str, launched: float, serves_at: float | None) -> Instance:
        self._ids += 1
        role = node.rpartition("-")[0]
        inst = Instance(f"i-{self._ids:017x}", node, role, group, version, launched, serves_at)
        self.outcome.instances.append(inst)
        return inst

    def run(self) -> Outcome:
        """Replay the update (and its rollback, if it fails) to its end."""
        for lid in self.after.res:
            self.state[lid] = "pending" if self.change[lid] != "same" else "done"
        # Each nested stack's resources (a cell's update completes when they all have), looked up once.
        self.children: dict[str, list[str]] = {}
        for lid in self.state:
            self.children.setdefault(scope_of(lid), []).append(lid)
        self._advance()
        while self.queue and not self._finished():
            t, _, fn = heapq.heappop(self.queue)
            self.now = max(self.now, t)
            fn()
            self._advance()
        o = self.outcome
        if self.failed_at is None:
            o.state = "UPDATE_COMPLETE"
        else:
            o.state = "UPDATE_ROLLBACK_FAILED" if self.rollback_failed or any(s != "done" for s in self.rb.values()) else "UPDATE_ROLLBACK_COMPLETE"
        o.ended, o.failed_at = self.now, self.failed_at
        o.alarms_at_once = self._alarms_at_once
        return o

    def _finished(self) -> bool:
        """The stack's operation is over: every resource updated, or every rollback done (or failed)."""
        if self.phase == "forward":
            return all(s == "done" for s in self.state.values())
        return self.rollback_failed or all(s == "done" for s in self.rb.values())

    def _advance(self) -> None:
        if self.phase == "forward":
            self._start_ready()
        if self.phase == "rollback":
            self._rollback_ready()

    def _start_ready(self) -> None:
        """DEPENDS_ON: a resource is created or updated once everything it depends on is; those that do
        not depend on each other go in parallel. NESTED_STACKS: a cell's resources once its stack's update starts."""
        moved = True
        while moved and self.phase == "forward":
            moved = False
            # By scope (the parent, then each cell, in template order): a cell whose update has not started holds all of its own.
            for scope, lids in self.children.items():
                if scope and self.state.get(scope) not in ("running", "done"):
                    continue
                for lid in lids:
                    if self.state[lid] == "pending" and all(self.state.get(d) == "done" for d in self.after.deps(lid)):
                        self.state[lid] = "running"
                        self._start(lid)
                        moved = True
            for lid, st in self.state.items():
                if (st == "running" and self.after.res[lid].get("Type") == "AWS::CloudFormation::Stack"
                        and all(self.state[c] == "done" for c in self.children.get(lid, []))):  # fmt: skip
                    self.state[lid] = "done"
                    moved = True

    def _done(self, lid: str) -> None:
        if self.phase == "forward" and self.state.get(lid) == "running":
            self.state[lid] = "done"

    def _fail(self, lid: str, why: str) -> None:
        """UPDATE_POLICY, WAIT_CONDITION: a failed resource fails its stack's update, and the parent's; the stack rolls back."""
        if self.phase != "forward":
            return
        self.state[lid] = "failed"
        self.outcome.reasons.append(f"{lid}: {why}")
        self.failed_at = self.now
        self.phase = "rollback"
        # Whatever was in progress stops; a surge's replacement that had not signalled is terminated.
        for group, (iid, _until, phase) in list(self.waiting.items()):
            if phase == "forward":
                for inst in self.instances.get(group, []):
                    if inst.id == iid and inst.ended is None:
                        inst.ended = self.now
                del self.waiting[group]
        touched = [k for k, s in self.state.items() if s != "pending" and self.change[k] != "same"]
        self.rb = {k: "pending" for k in touched}

    def _start(self, lid: str) -> None:
        res = self.after.res[lid]
        kind = res.get("Type")
        if kind == "AWS::CloudFormation::WaitConditionHandle":
            # WAIT_CONDITIONS_GUIDE: the handle's presigned URL is made with the handle, valid 24 hours from then.
            self.handles[lid] = self.now
            self._done(lid)
        elif kind == "AWS::EC2::LaunchTemplate":
            # LAUNCH_TEMPLATE: new LaunchTemplateData is a new version, whose user data names the handle it refers to.
            self.version[lid] = ("after", lid)
            self._done(lid)
        elif kind == "AWS::AutoScaling::AutoScalingGroup":
            self._group(lid)
        elif kind == "AWS::CloudFormation::WaitCondition":
            self._wait_condition(lid)
        elif kind == "AWS::CloudFormation::Stack":
            pass  # done when its resources are (_start_ready)
        elif kind == "AWS::CloudWatch::Alarm":
            # CLOUDWATCH_QUOTAS: each is one PutMetricAlarm call, issued when the alarm's turn comes; the
            # model gives the call ALARM_S (an assumption: CloudFormation's own steps are otherwise instant).
            self._in_flight += 1
            self._alarms_at_once = max(self._alarms_at_once, self._in_flight)
            self.at(self.now + ALARM_S, lambda: self._alarm_made(lid))
        else:
            self._done(lid)

    def _alarm_made(self, lid: str) -> None:
        self._in_flight -= 1
        self._done(lid)

    def _rolls(self, stack: Stack, lid: str, change: Mapping[str, str]) -> bool:
        """UPDATE_POLICY: a group's rolling update replaces its instances when its launch template (or subnet, placement) changes."""
        lt = stack.launch_template_of(lid)
        props = ("VPCZoneIdentifier", "PlacementGroup", "LaunchConfigurationName", "MixedInstancesPolicy")
        before = self.before.res.get(lid, {}).get("Properties", {})
        after = self.after.res.get(lid, {}).get("Properties", {})
        return (lt is not None and change.get(lt) in ("new", "changed")) or any(before.get(p) != after.get(p) for p in props)

    def _group(self, lid: str) -> None:
        node = self.after.node_of(lid) or lid
        if self.change[lid] == "new":
            # A new node (a first deploy, a grown fleet): its group launches its instance and is created.
            self._launch(lid, node, self.after, "new")
            self._done(lid)
            return
        if not self._rolls(self.after, lid, self.change):
            self._done(lid)  # MaxSize, policies, tags: updated in place, no instance replaced
            return
        self.outcome.turns[node] = self.now
        self._roll(lid, node, self.after, "forward")

    def _roll(self, lid: str, node: str, stack: Stack, phase: str) -> None:
        """UPDATE_POLICY (AutoScalingRollingUpdate): replace the group's instance, one batch. With
        MinInstancesInService 1 (under MaxSize 2) the new one launches beside the old; else the old is
        terminated first. With WaitOnResourceSignals the update waits for the new instance's signal up
        to PauseTime; a FAILURE, or none in time ("Each resource signal timeout is counted as a
        FAILURE"), fails the batch unless MinSuccessfulInstancesPercent (default 100) is met without it.
        The old instance is terminated once the batch succeeded. LIFECYCLE_HOOKS: CloudFormation does
        not wait for a terminating instance's hook (its drain)."""
        res = stack.res[lid]
        policy = (res.get("UpdatePolicy") or {}).get("AutoScalingRollingUpdate") or {}
        surge = int(policy.get("MinInstancesInService", 0)) >= 1 and int(res["Properties"].get("MaxSize", "1")) >= 2
        wait = bool(policy.get("WaitOnResourceSignals"))
        pause = min(_seconds(policy.get("PauseTime", "PT0S")), PAUSE_MAX_S)
        self.min_success[lid] = int(policy.get("MinSuccessfulInstancesPercent", 100))
        old = [i for i in self.instances.get(lid, []) if i.ended is None]
        if not surge:
            for i in old:
                self._terminate(i)
        inst = self._launch(lid, node, stack, "new" if phase == "forward" else "previous")
        if wait:
            self.waiting[lid] = (inst.id, self.now + pause, phase)
            self.at(self.now + pause, lambda: self._signal_timeout(lid, inst.id))
            return
        if surge:
            for i in old:
                self._terminate(i)
        self._group_done(lid, phase)

    def _group_done(self, lid: str, phase: str) -> None:
        if phase == "forward":
            self._done(lid)
        else:
            self.rb[lid] = "done"

    def _terminate(self, inst: Instance) -> None:
        inst.ended = self.now
        inst.drained = self.now + self.drain_s

    def _signal_timeout(self, group: str, iid: str) -> None:
        w = self.waiting.get(group)
        if w is None or w[0] != iid:
            return
        if self.min_success.get(group, 100) == 0:
            # 0 of 1 signalled SUCCESS satisfies 0 %: the batch is done, the new instance stays.
            del self.waiting[group]
            self._group_done(group, w[2])
            return
        del self.waiting[group]
        inst = next(i for i in self.instances[group] if i.id == iid)
        inst.ended = self.now
        why = f"received no SUCCESS signal from {iid} within PauseTime"
        if w[2] == "forward":
            self._fail(group, why)
        else:
            self.rollback_failed = True
            self.outcome.reasons.append(f"{group} (rollback): {why}")

    def _group_signal(self, group: str, iid: str, status: str) -> None:
        """UPDATE_POLICY: a signal for an instance of a group waiting on it; any other is refused ("cannot be signaled")."""
        w = self.waiting.get(group)
        if w is None or w[0] != iid:
            return
        del self.waiting[group]
        new = next(i for i in self.instances[group] if i.id == iid)
        if status == "SUCCESS" or self.min_success.get(group, 100) == 0:
            for i in self.instances[group]:
                if i.id != iid and i.ended is None:
                    self._terminate(i)
            self._group_done(group, w[2])
            return
        new.ended = self.now
        if w[2] == "forward":
            self._fail(group, f"{iid} signalled FAILURE")
        else:
            self.rollback_failed = True
            self.outcome.reasons.append(f"{group} (rollback): {iid} signalled FAILURE")

    def _launch(self, group: str, node: str, stack: Stack, version: str) -> Instance:
        role = node.rpartition("-")[0]
        lt = stack.launch_template_of(group)
        assert lt is not None, group
        which, lt_lid = self.version.get(lt, ("before" if stack is self.before else "after", lt))
        template_stack = self.after if which == "after" else self.before
        handle = template_stack.handle_of(lt_lid)
        env = template_stack.node_env(lt_lid)
        times = self.times.serve_s if version == "new" else (self.times.rollback_serve_s or self.times.serve_s)
        serves = self.now + times[role]
        fails = version == "new" and node in self.times.fails
        inst = self._instance(node, group, version, self.now, None if fails else serves)
        self.instances.setdefault(group, []).append(inst)
        if handle is None:
            return inst
        made = self.handles.get(handle, self.now)
        gate = next((c for c in template_stack.res if template_stack.res[c].get("Type") == "AWS::CloudFormation::WaitCondition"
                     and handle.rpartition("/")[2] in refs(template_stack.res[c].get("Properties", {}))
                     and scope_of(c) == scope_of(handle)), None)  # fmt: skip
        # A gate of the running template was answered when it was deployed (its stack completed).
        answered = gate is not None and (gate in self.before.res or any(s == "SUCCESS" for _, s in self.handle_signals.get(handle, [])))
        actions, out = run_signal(
            env=env, url=handle_url(self.epoch + made), launched=self.epoch + self.now, verdict_at=self.epoch + serves,
            verdict="failure" if fails else "success", instance=inst.id, stack=scope_of(group) or "parent",
            group=group.rpartition("/")[2], gate=gate.rpartition("/")[2] if gate else None, gate_answered=answered,
        )  # fmt: skip
        self.outcome.outputs[inst.id] = out
        budget = int(env.get("GPTOSS_READY_TIMEOUT_S", "0")) - int(env.get("GPTOSS_SIGNAL_MARGIN_S", "300"))
        for a in actions:
            t = a.at - self.epoch
            if a.status == "FAILURE" and "deploy gate's timeout" in a.reason and not fails and times[role] < budget:
                self.outcome.late.append(f"{node} ({inst.id}): {a.reason}")
            if a.kind == "handle":
                self.at(t, lambda h=handle, s=a.status, t=t: self._handle_signal(h, t, s))
            else:
                self.at(t, lambda g=group, i=inst.id, s=a.status: self._group_signal(g, i, s))
        if version == "new" and not fails:
            self.outcome.served.setdefault(node, serves)
        return inst

    def _handle_signal(self, handle: str, t: float, status: str) -> None:
        self.handle_signals.setdefault(handle, []).append((t, status))
        for lid, st in self.state.items():
            if st == "running" and self.after.res[lid].get("Type") == "AWS::CloudFormation::WaitCondition" and self._handle_of_condition(lid) == handle:
                self._judge(lid)

    def _handle_of_condition(self, lid: str) -> str:
        ref = self.after.res[lid]["Properties"]["Handle"]["Ref"]
        scope = scope_of(lid)
        return f"{scope}/{ref}" if scope else ref

    def _wait_condition(self, lid: str) -> None:
        """WAIT_CONDITION: it waits for Count SUCCESS signals on its handle (signals sent before it was
        created count) and fails on a FAILURE signal or when Timeout has passed since it was created."""
        timeout = float(self.after.res[lid]["Properties"]["Timeout"])
        self.at(self.now + timeout, lambda: self._wait_timeout(lid))
        self._judge(lid)

    def _judge(self, lid: str) -> None:
        signals = self.handle_signals.get(self._handle_of_condition(lid), [])
        if any(s == "FAILURE" for _, s in signals):
            self._fail(lid, "the handle received a FAILURE signal")
        elif sum(1 for _, s in signals if s == "SUCCESS") >= int(self.after.res[lid]["Properties"].get("Count", 1)):
            self._done(lid)

    def _wait_timeout(self, lid: str) -> None:
        if self.phase == "forward" and self.state.get(lid) == "running":
            self._fail(lid, "timed out (WaitCondition Timeout since its creation)")

    # ---- rollback

    def _rollback_ready(self) -> None:
        """UPDATE_POLICY, ROLLBACK_FAILED: a failed update rolls back by re-applying the previous template
        (its dependencies, its UpdatePolicy, its launch template data) to what the update changed;
        what it made is deleted afterwards. NESTED_STACKS: a cell rolls back with its stack, in the
        previous template's DependsOn order. A resource that cannot be rolled back (a group whose
        rollback gets no SUCCESS signal) leaves the stack in UPDATE_ROLLBACK_FAILED."""
        moved = True
        while moved and not self.rollback_failed:
            moved = False
            for lid, st in self.rb.items():
                if st != "pending" or (scope_of(lid) and self.rb.get(scope_of(lid), "done") == "pending"):
                    continue
                deps = self.before.deps(lid) if lid in self.before.res else set()
                if any(self.rb.get(d, "done") != "done" for d in deps):
                    continue
                self.rb[lid] = "running"
                self._roll_back(lid)
                moved = True
            for lid, st in self.rb.items():
                cell = st == "running" and self.after.res[lid].get("Type") == "AWS::CloudFormation::Stack"
                if cell and all(self.rb[c] == "done" for c in self.rb if scope_of(c) == lid):
                    self.rb[lid] = "done"
                    moved = True

    def _roll_back(self, lid: str) -> None:
        kind = self.after.res[lid].get("Type")
        if self.change[lid] == "new":
            self.rb[lid] = "done"  # made by this update: deleted in the cleanup
        elif kind == "AWS::CloudFormation::Stack":
            pass  # done when its resources are
        elif kind == "AWS::EC2::LaunchTemplate":
            self.version[lid] = ("before", lid)  # LAUNCH_TEMPLATE: the previous data, as a new version
            self.rb[lid] = "done"
        elif kind == "AWS::AutoScaling::AutoScalingGroup" and self._rolls(self.after, lid, self.change):
            node = self.after.node_of(lid) or lid
            self.outcome.rollback_turns[node] = self.now
            self._roll(lid, node, self.before, "rollback")
        else:
            self.rb[lid] = "done"


def replay(before: Resources, after: Resources, times: NodeTimes, **kw: Any) -> Outcome:
    """Replay one update; see Replay."""
    return Replay(before, after, times, **kw).run()



# ---- a deploy, as `gptoss deploy` makes it, replayed ------------------------------------------------------------


@dataclass
class Deploy:
    """A change deployed the way `gptoss deploy` deploys it (its surge decision, its updates), replayed."""

    context: dict[str, str]  # what the change was synthesized with (rollout.surge=off added when the deploy turns it off)
    surge_off: str  # why the deploy turned surge off ('' when it did not)
    updates: list[tuple[str, Outcome]]  # ('policy' | 'change', its replay), in order
    before: Resources  # the running stack before the change update (after the policy update, if any)
    after: Resources

    @property
    def change(self) -> Outcome:
        return self.updates[-1][1]


# Flattened template sets by the id of the set (held with it, so the id stays its own).
_FLAT: dict[int, tuple[Any, Any]] = {}


def replay_deploy(
    deployed: dict[str, Template],
    synth: Callable[[dict[str, str]], dict[str, Template]],
    context: dict[str, str],
    minutes: Mapping[str, float],
    fails: frozenset[str] = frozenset(),
) -> Deploy:
    """Deploy CONTEXT over DEPLOYED (templates, as cluster_ops.rollout holds them) as `gptoss deploy`
    does: the surge decision for a node time of MINUTES (what the last deploy measured), then each of
    its updates (cluster_ops.policy_update.updates), each replayed; a failed update ends the deploy."""
    from cluster_ops.policy_update import capacity_moves, image_changes, surge_for, surge_off_because, updates
    from cluster_ops.rollout import compare, flatten_templates
    from clusterspec.loading import load_config

    local: dict[int, tuple[Any, Any]] = {}

    def flat(templates: dict[str, Template]) -> Template:
        """Each template set flattened once. The deployed and synthesized sets are the synth's own (cached by it,
        never changed) and stay flattened for the session; the sets this deploy's updates make, for this call only."""
        memo = _FLAT if any(templates is t for t in kept) else local
        if id(templates) not in memo:
            memo[id(templates)] = (templates, flatten_templates(templates))
        return memo[id(templates)][1]

    cfg = load_config(context)
    target = synth(dict(context))
    kept = [deployed, target]
    why = ""
    moves: dict[str, Any] = {}
    if compare(flat(deployed), flat(target)).replaced:
        image = image_changes(flat(deployed), flat(target))
        why = surge_off_because(cfg, ready_min=max(minutes.values()), image_changed=image)
        moves = capacity_moves(flat(deployed), flat(target))
    surge = surge_for(cfg, why, moves)
    ctx = dict(context) | ({"rollout.surge": surge} if surge else {})
    if surge:
        target = synth(ctx)
        kept.append(target)
    times = NodeTimes({role: m * 60 for role, m in minutes.items()}, fails)
    drain = float(load_config(ctx).rollout.drain_s)
    state, done = deployed, []
    before = flat(state)
    for name, templates in updates(deployed, target):
        before = flat(state)
        outcome = replay(before, flat(templates), times, drain_s=drain)
        done.append((name, outcome))
        if outcome.state != "UPDATE_COMPLETE":
            break
        state = templates
    return Deploy(ctx, why, done, before, flat(target))
