"""Shared fixtures: each stack is synthesized once per test run."""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster_ops.rollout import substitute
from node_render.paths import member_host

ROOT = Path(__file__).resolve().parent.parent
CDK = ROOT / "node_modules" / ".bin" / "cdk"
STACK = "GptOss8k1kStack"
# The project's Node.js LTS (package.json) for the CDK CLI and the jsii runtime, as `make` sets it.
os.environ["PATH"] = f"{ROOT / 'node_modules' / '.bin'}{os.pathsep}{os.environ.get('PATH', '')}"
# As app.py does: CDK's built-in CloudFormation validator off in the in-process synths (the
# tests run cfn-lint on the templates instead); set before aws_cdk starts its runtime.
os.environ.setdefault("CDK_VALIDATION", "false")
# Hypothesis keeps what it learns (its example database, a cache of the code's constants) in
# .hypothesis/ of the working directory: a directory of this run's own instead, so nothing is
# written to the checkout and two runs on one machine share nothing.
# It is removed when the process that made it exits (it was left behind: hundreds after a day of runs).
if "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ:
    os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = tempfile.mkdtemp(prefix="gptoss-hypothesis-")
    atexit.register(shutil.rmtree, os.environ["HYPOTHESIS_STORAGE_DIRECTORY"], ignore_errors=True)
# moto's EC2 loads every Amazon AMI it knows for the region (about 1,100 in us-east-2: its "latest"
# and ECS-optimized lists) into each new backend, and serializes them all for a describe_images by
# owner: about 1 s of CPU for each mock_aws test and moto server. Its own base list of 44 instead
# (moto's MOTO_AMIS_PATH setting), before moto is imported; the moto servers inherit it. Tests
# name images from that list (ami-12c6146b) or take the first one.
if "MOTO_AMIS_PATH" not in os.environ:
    import gzip
    import importlib.util

    _spec = importlib.util.find_spec("moto")
    assert _spec is not None and _spec.origin is not None, "moto is installed by `make setup`"
    _amis = Path(_spec.origin).parent / "ec2" / "resources" / "amis.json.gz"
    _fd, _path = tempfile.mkstemp(prefix="gptoss-moto-amis-", suffix=".json")
    with os.fdopen(_fd, "wb") as _f:
        _f.write(gzip.decompress(_amis.read_bytes()))
    os.environ["MOTO_AMIS_PATH"] = _path
    atexit.register(os.unlink, _path)


def cli_env(**extra: str) -> dict[str, str]:
    """Environment of every CDK CLI call: quiet, offline, no credentials needed."""
    env = {
        **os.environ,
        "AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED": "true",
        "CDK_DISABLE_CLI_TELEMETRY": "true",
        "AWS_REGION": "us-east-2",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    env.update(extra)
    return env


def gptoss_in_process(*argv: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`gptoss ARGV` run in this process (cluster_ops.cli.main, what the entry point calls), its exit code and its two
    streams as a subprocess's: for a test that checks what the command says, not its process (the CLI's imports
    cost a process about 0.7 s of CPU). ENV replaces os.environ for the call, as a subprocess's env= does.
    What only a process shows (a closed pipe, the installed entry point) keeps its subprocess."""
    import contextlib
    import io

    from cluster_ops import cli

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(argv))
            except SystemExit as e:  # argparse: --help (0) and a bad option (2)
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["gptoss", *argv], code, out.getvalue(), err.getvalue())


def flatten(parent: dict[str, Any], nested: Callable[[str, dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """The parent template with every cell's resources in it, as one template reads: a cell's
    parameters replaced by what the parent passes it, and its resources created after what the
    cell's nested stack resource waits for. The nested stack resources stay (tests count cells)."""
    out = json.loads(json.dumps(parent))
    for lid, res in parent["Resources"].items():
        if res["Type"] != "AWS::CloudFormation::Stack":
            continue
        child = nested(lid, res)
        params = res["Properties"].get("Parameters", {})
        after = res.get("DependsOn", [])
        for clid, cres in child["Resources"].items():
            if cres["Type"] == "AWS::CDK::Metadata":
                continue
            assert clid not in out["Resources"], f"{clid} is in two templates"
            flat = substitute(cres, params)
            flat["DependsOn"] = sorted({*(flat.get("DependsOn") or []), *([after] if isinstance(after, str) else after)})
            out["Resources"][clid] = flat
    return out


def nested_templates(outdir: Path, parent: dict[str, Any]) -> dict[str, Path]:
    """The nested templates the CLI wrote for a parent, by the parent's logical id of each."""
    return {lid: outdir / res["Metadata"]["aws:asset:path"] for lid, res in parent["Resources"].items()
            if res["Type"] == "AWS::CloudFormation::Stack"}  # fmt: skip


class Synth:
    """One `cdk synth` through the pinned CLI: its template (the parent with its cells' resources, see
    `flatten`), every template file it wrote, and its validation report."""

    def __init__(self, outdir: Path, result: subprocess.CompletedProcess[str]):
        self.outdir = outdir
        self.result = result
        self.template_path = outdir / f"{STACK}.template.json"
        self.parent: dict[str, Any] = json.loads(self.template_path.read_text())
        self.nested_paths = nested_templates(outdir, self.parent)
        self.template: dict[str, Any] = flatten(self.parent, lambda lid, res: json.loads(self.nested_paths[lid].read_text()))
        self.template_paths = [self.template_path, *self.nested_paths.values()]
        report = outdir / "validation-report.json"
        self.report: dict[str, Any] = json.loads(report.read_text()) if report.exists() else {}

    def resources(self, rtype: str) -> dict[str, dict[str, Any]]:
        """Resources of one CloudFormation type, by logical id."""
        return {k: v for k, v in self.template["Resources"].items() if v["Type"] == rtype}

    def software(self) -> bytes:
        """The software asset the stack ships (every node's files and the shared scripts), as the CLI staged it."""
        text = "".join(p.read_text() for p in self.template_paths)
        found = [p for p in self.outdir.glob("asset.*.xz") if f"{p.name.split('.')[1]}.xz" in text]
        assert len(found) == 1, f"one software asset is named by the templates, found {found}"
        return found[0].read_bytes()


def run_cli_synth(outdir: Path, *context: str) -> Synth:
    """Run the pinned CLI, failing the test with its output if synth fails."""
    args = [str(CDK), "synth", STACK, "--no-notices", "--quiet", "-o", str(outdir)]
    for c in context:
        args += ["-c", c]
    result = subprocess.run(args, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"cdk synth failed:\n{result.stdout}\n{result.stderr}"
    return Synth(outdir, result)


@pytest.fixture(autouse=True)
def _scripts_write_under_the_tests_own_directories(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test writes this machine's /run/gptoss: a node script run without its own GPTOSS_RUN_DIR (or the
    collector, which reads it at import) writes under the test's directory; a test that sets it keeps its
    own. (GPTOSS_STATE_DIR is not set here: the CLI reads it too, for the checkout's own records.)"""
    monkeypatch.setenv("GPTOSS_RUN_DIR", str(tmp_path_factory.mktemp("node-run")))


@pytest.fixture(scope="session")
def run_shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory the workers of this run share (pytest-xdist's: the parent of each worker's base
    directory), and only this run: what one worker synthesized, the others read instead of synthesizing it again."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    shared.mkdir(exist_ok=True)
    return shared


def once(shared: Path, key: str, make: Callable[[Path], None]) -> Path:
    """MAKE(directory) once for KEY among the run's workers (the first takes the key's lock, the others wait
    for it and read what it wrote); the directory is returned. A MAKE that failed is run again by the next."""
    folder = shared / hashlib.sha256(key.encode()).hexdigest()[:20]
    with (shared / f"{folder.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / ".done").touch()
    return folder


@pytest.fixture(scope="session")
def cli_synth(run_shared: Path) -> Callable[..., Synth]:
    """`cdk synth GptOss8k1kStack -c ...` through the pinned CLI, once per context in the whole run."""
    cache: dict[tuple[str, ...], Synth] = {}

    def make(folder: Path, context: tuple[str, ...]) -> None:
        synth = run_cli_synth(folder / "cdk.out", *context)
        (folder / "result.json").write_text(json.dumps({"args": synth.result.args, "returncode": synth.result.returncode,
                                                        "stdout": synth.result.stdout, "stderr": synth.result.stderr}))  # fmt: skip

    def get(*context: str) -> Synth:
        if context not in cache:
            folder = once(run_shared, json.dumps(["cli", *context]), lambda f: make(f, context))
            r = json.loads((folder / "result.json").read_text())
            cache[context] = Synth(folder / "cdk.out", subprocess.CompletedProcess(r["args"], r["returncode"], r["stdout"], r["stderr"]))
        return cache[context]

    return get


@pytest.fixture(scope="session")
def default_synth(cli_synth: Callable[..., Synth]) -> Synth:
    """The tested two-node 6P1D stack."""
    return cli_synth()


@pytest.fixture(scope="session")
def fleet_synth(cli_synth: Callable[..., Synth]) -> Synth:
    """The production layout: 3 prefill + 8 decode instances."""
    return cli_synth("decode_instances=8")


def _variant(context: dict[str, Any]) -> dict[str, Any]:
    """The flattened template of a parameter variant, synthesized in this process (its jsii runtime)."""
    import aws_cdk as cdk
    from aws_cdk.assertions import Template

    from clusterspec.loading import load_config
    from stacks.cluster_stack import GptOssClusterStack

    # The feature flags of cdk.json, as the CLI passes them (policy minimization among them).
    app = cdk.App(context=json.loads((ROOT / "cdk.json").read_text())["context"])
    stack = GptOssClusterStack(app, STACK, config=load_config(context))
    by_lid = {stack.get_logical_id(c.nested_stack_resource): c for c in (*stack.cells.values(), *stack.alarm_cells.values())}  # type: ignore[arg-type]
    return flatten(dict(Template.from_stack(stack).to_json()), lambda lid, res: dict(Template.from_stack(by_lid[lid]).to_json()))


@pytest.fixture(scope="session")
def synth_variant(run_shared: Path) -> Callable[..., dict[str, Any]]:
    """In-process template of a parameter variant, once per variant in the whole run (a worker reads what another made)."""
    cache: dict[str, dict[str, Any]] = {}

    def get(**context: Any) -> dict[str, Any]:
        key = json.dumps(context, sort_keys=True)
        if key not in cache:
            folder = once(run_shared, "variant " + key, lambda f: (f / "template.json").write_text(json.dumps(_variant(context))))
            cache[key] = json.loads((folder / "template.json").read_text())
        return cache[key]

    return get


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """Drop the traceback of a client that hung up (curl's --max-time)."""


class _HealthRoutes(http.server.BaseHTTPRequestHandler):
    """200 on /health, /healthcheck and /ready; 404 elsewhere."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path in ("/health", "/healthcheck", "/ready") else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Keep test output clean."""


def serve_health(host: str = "127.0.0.1", port: int = 0) -> http.server.ThreadingHTTPServer:
    """A loopback HTTP server answering the health routes, serving until shut down."""
    server = _QuietServer((host, port), _HealthRoutes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def health_server() -> Iterator[str]:
    """A loopback HTTP server answering 200 on /health, /healthcheck and /ready; yields its base URL."""
    server = serve_health()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# ---- the node's files, as tests run them -------------------------------------------------

# Values a server may legally be given that every layer (YAML, env file, unit, shell) could mangle.
ODD_VALUES = [
    "gpt oss 120b",
    "prix: 50% off",
    "cost=$HOME;rm -rf x",
    "naïve – ünïcode ✓",
    'say "hi"',
    "a;b|c&d",
    "${NOT_EXPANDED}",
    "%i %n %%",
]

SOFTWARE_PARAMETER = "/gptoss/gptoss-8k1k/software"
CACHE_URI = "s3://gptoss-8k1k-compilecachebucket-0123456789ab"


def rendered_services(**context: str) -> dict[str, dict[str, Any]]:
    """Every service the plan renders for this context, by unit (and step): node, environment, argv."""
    from clusterspec.loading import load_config
    from node_render.render import render_cluster

    out = {}
    for node in render_cluster(load_config(context)):
        for s in node.services:
            out[s.unit + (f":{s.step}" if s.step else "")] = {"node": node.node.name, "env": s.environment, "argv": s.argv}
    return out


def argv_flags(argv: list[str]) -> dict[str, Any]:
    """Flag -> value (None for a bare switch), JSON values parsed; argv[3:] after `vllm serve MODEL`."""
    out: dict[str, Any] = {}
    i = 3
    while i < len(argv):
        flag = argv[i]
        assert flag.startswith("--"), argv[i:]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            out[flag] = json.loads(value) if value[:1] in "{[" else value
            i += 2
        else:
            out[flag] = None
            i += 1
    return out


def node_user_data(render: Any) -> str:
    """A node's user data with the deploy-time values a test chooses (CloudFormation's at deploy)."""
    from node_render.userdata import user_data

    return user_data(render, software_parameter=SOFTWARE_PARAMETER, compile_cache_uri=CACHE_URI)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Write a script as a node receives it (comments or docstrings stripped); returns its path."""
    from node_render.node_scripts import node_script

    folder = tmp_path_factory.mktemp("shipped")

    def write(name: str) -> Path:
        p = folder / name
        text = node_script(name)
        p.write_text(text)
        p.chmod(0o755)
        # The modules it imports, beside it as on the node (the scripts' folder is first on Python's path).
        for module in ("gptoss_node", "gptoss_drain", "gptoss_fleet"):
            if re.search(rf"^(from|import) {module}\b", text, re.M):
                (folder / f"{module}.py").write_text(node_script(f"{module}.py"))
        # The settings' prologue its bash sources, beside it as on the node.
        if '/gptoss-env"' in text:
            (folder / "gptoss-env").write_text(node_script("gptoss-env"))
        return p

    return write


def fake_command(folder: Path, name: str, body: str) -> Path:
    """An executable bash stand-in for a command the scripts call (lsblk, aws, systemctl, ...)."""
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + body)
    p.chmod(0o755)
    return p


# The AWS CLI the nodes' scripts run in tests (`make setup` installs it: the Makefile's AWS_CLI).
AWS_CLI = ROOT / ".aws-cli" / "1.46.3"


def real_aws_cli(folder: Path) -> Path:
    """`aws` in FOLDER: the real AWS CLI, for scripts and commands that call it by name."""
    assert AWS_CLI.is_dir(), f"{AWS_CLI} is missing: `make setup` installs the AWS CLI the node scripts run"
    return fake_command(folder, "aws", f'PYTHONPATH="{AWS_CLI}" exec "{sys.executable}" -m awscli "$@"\n')


OTHER_RECIPES = ("gptoss-120b-single", "gptoss-20b-single", "gptoss-120b-di", "gptoss-20b-di")


def nag_synth(outdir: Path, stacks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Stacks of several configs synthesized in one app with cdk-nag, as app.py builds them.

    `stacks` maps a key to the context of its config (the stack's id is its stack name, or the
    key when two share a name). Returns {"outdir", "paths", "templates" by key, "report"}.
    """
    import aws_cdk as cdk
    from cdk_nag import AwsSolutionsChecks

    from clusterspec.loading import load_config
    from node_render import limits
    from stacks.cluster_stack import GptOssClusterStack

    # What the CLI asks of an app: path metadata on every resource (cfn-lint reads it).
    app = cdk.App(outdir=str(outdir), context={"aws:cdk:enable-path-metadata": True, "aws:cdk:enable-asset-metadata": True})
    names = {}
    for key, context in stacks.items():
        cfg = load_config(context)
        limits.check(cfg)
        name = cfg.stack_name if cfg.stack_name not in names.values() else "".join(w.capitalize() for w in re.split(r"\W+", key))
        GptOssClusterStack(app, name, config=cfg)
        names[key] = name
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    app.synth()
    report = outdir / "validation-report.json"
    parents = {k: json.loads((outdir / f"{n}.template.json").read_text()) for k, n in names.items()}
    nested = {k: nested_templates(outdir, t) for k, t in parents.items()}
    return {
        "outdir": outdir,
        # Every template file: the parents' and their cells'.
        "paths": {k: outdir / f"{n}.template.json" for k, n in names.items()}
        | {f"{k}/{lid}": path for k, paths in nested.items() for lid, path in paths.items()},
        "templates": {k: flatten(t, lambda lid, res, k=k: json.loads(nested[k][lid].read_text())) for k, t in parents.items()},  # type: ignore[misc]
        "report": json.loads(report.read_text()) if report.exists() else {},
    }


def cfn_lint(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    """cfn-lint over templates; E3628 (unknown instance type) only is ignored: its data has no trn3 yet."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "cfn-lint"), "--regions", "us-east-2", "--ignore-checks", "E3628", "--", *map(str, paths)],
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="session")
def recipe_synth(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The four other recipes' stacks, synthesized once in one app with cdk-nag."""
    return nag_synth(tmp_path_factory.mktemp("recipes.out"), {r: {"recipe": r} for r in OTHER_RECIPES})


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto server on a free loopback port (the host name `localhost`, as the CDK and the AWS CLI need)."""
    from tests.local_moto import MotoServer

    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server.url
    finally:
        server.stop()


def private_etc(tmp: Path, hosts: dict[str, str]) -> Path:
    """An /etc for a process of its own: the resolver's configuration and a hosts file that names
    each node (NODE.gptoss.internal) as gptoss-members does on a node. A directory, so that a
    rewrite by rename (what gptoss-members does) reaches the process, as /etc/hosts does on a node."""
    etc = tmp / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    for name in ("nsswitch.conf", "host.conf", "gai.conf", "resolv.conf"):
        if Path("/etc", name).is_file():
            shutil.copy(Path("/etc", name), etc / name)
    (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{ip} {member_host(n)}\n" for n, ip in hosts.items()))
    return etc


def with_etc(argv: list[str], etc: Path) -> list[str]:
    """argv in a mount namespace of its own whose /etc is `etc` (root, or an unprivileged user namespace)."""
    assert shutil.which("unshare"), "unshare (util-linux) runs the router with the nodes' names in its own /etc"
    unshare = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    return [*unshare, "sh", "-c", 'mount --bind "$0" /etc && exec "$@"', str(etc), *argv]
