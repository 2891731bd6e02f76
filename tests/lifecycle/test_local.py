"""The README's local lifecycle, run as written against moto on localhost: up, status, diff, down,
then the account's resources listed by this test: nothing the lifecycle made is left."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.lifecycle.local_aws import LocalAws, inventory
from tests.local_moto import MotoServer, free_port

pytestmark = pytest.mark.lifecycle


def readme_block() -> list[str]:
    """The commands of the README's local section (its ```shell block), as written."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Try the whole lifecycle locally") :]
    (body,) = re.findall(r"```shell\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    return [line for line in body.splitlines() if line.strip()]


@pytest.fixture
def moto(tmp_path: Path) -> Iterator[str]:
    """A moto server of this test's own (it outlives `make local-down`, so the test can look after it)."""
    server = MotoServer(tmp_path / "moto.log", extended=True)
    try:
        yield server.url
    finally:
        server.stop()


def test_the_readme_local_lifecycle_runs_as_written_and_leaves_nothing(moto: str, tmp_path: Path) -> None:
    lines = readme_block()
    assert lines[0].startswith("make local") and lines[-2].startswith("make local-down"), lines
    assert lines[-1].startswith('eval "$(.venv/bin/gptoss local env --unset)"'), lines
    # Each command as written, its exit code recorded after it; all in one shell (the eval carries).
    script = "\n".join(f"{line}\necho \"::rc $? :: {i}\"" for i, line in enumerate(lines)) + '\necho "::endpoint ${AWS_ENDPOINT_URL-none}"'

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"GPTOSS_LOCAL_ENDPOINT": moto, "GPTOSS_STATE_DIR": str(tmp_path / "state"), "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}  # fmt: skip
    aws = LocalAws(moto, env, tmp_path / "unused.yaml")
    before = inventory(aws)
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    codes = {int(i): int(rc) for rc, i in re.findall(r"::rc (\d+) :: (\d+)", r.stdout)}
    assert sorted(codes) == list(range(len(lines))), out[-4000:]
    for i, line in enumerate(lines):
        said = re.search(r"# exits (\d+)", line)
        assert codes[i] == (int(said.group(1)) if said else 0), f"{line!r} exited {codes[i]}\n{out[-4000:]}"
    assert "Traceback" not in out
    # No warning of the project's own making (CDK's deprecations), and each synth warning once per command
    # that reads an assembly: up's deploy and diff (their synths' own output is not repeated).
    assert "is deprecated" not in out, [line for line in out.splitlines() if "deprecated" in line]
    warnings = re.findall(r"Acknowledge with '(Annotation::[\w:-]+)'", out)
    assert warnings and all(warnings.count(w) == 2 for w in warnings), sorted(set((w, warnings.count(w)) for w in warnings))
    assert "::endpoint none" in r.stdout, "the shell's AWS clients point at AWS again"
    # up: the stack deployed through gptoss deploy, both identities shown with their instances, the cause named.
    assert "stack GptOssLocalStack · region us-east-2 · cluster tag gptoss:cluster=gptoss-local" in out
    assert "✅  GptOssLocalStack" in out
    assert re.search(r"prefill-0\s+│ i-[0-9a-f]{17}", out) and re.search(r"decode-0\s+│ i-[0-9a-f]{17}", out), out[-4000:]
    assert "likely cause: prefill-0, decode-0: Run Command succeeded with no output." in " ".join(out.split())
    assert "local cluster GptOssLocalStack is up in" in out
    # diff right after up: nothing differs, in the stack, its two cells or their alarms, said at once (no change set to wait for).
    assert "makes no change sets: comparing the deployed templates with the synthesized ones" in out, out[-4000:]
    assert out.count("There were no differences") == 5 and "Number of stacks with differences: 0" in out, out[-6000:]
    # down: destroyed through gptoss destroy; it says nothing is left ...
    assert "gptoss destroy" in out and "left in the local account: nothing" in out, out[-4000:]
    assert 'leave it with: eval "$(.venv/bin/gptoss local env --unset)"' in out
    # ... and the account, listed here, agrees: every resource the lifecycle made is gone.
    after = inventory(aws)
    left = {k: sorted(after[k] - before[k]) for k in after if after[k] - before[k]}
    assert left == {}, left
    stacks = [s for s in aws.client("cloudformation").list_stacks()["StackSummaries"] if s["StackStatus"] != "DELETE_COMPLETE"]
    assert stacks == [], [s["StackName"] for s in stacks]
    assert aws.client("s3").list_buckets()["Buckets"] == []
    assert aws.client("ssm").describe_parameters()["Parameters"] == []


def test_local_down_with_nothing_running_says_so_and_local_up_refuses_another_service(tmp_path: Path) -> None:
    """No server on the port: down has nothing to remove (exit 0). Something that is not moto on it:
    up refuses in one line, before anything is started or deployed."""
    import http.server
    import threading

    gptoss = str(Path(sys.executable).parent / "gptoss")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | {"GPTOSS_STATE_DIR": str(tmp_path)}
    port = free_port()
    r = subprocess.run([gptoss, "local", "down"], env=env | {"GPTOSS_LOCAL_PORT": str(port)}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"nothing answers on http://localhost:{port}: nothing to remove" in r.stderr, r.stderr
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = subprocess.run([gptoss, "local", "up"], env=env | {"GPTOSS_LOCAL_PORT": str(server.server_port)}, capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    finally:
        server.shutdown()
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"gptoss local: something that is not moto answers on http://localhost:{server.server_port}. "
                                             "Fix: stop it, or pick a free port: GPTOSS_LOCAL_PORT=PORT make local"]  # fmt: skip
    r = subprocess.run([gptoss, "local", "up"], env=env | {"GPTOSS_LOCAL_ENDPOINT": "http://10.1.2.3:4566"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "acts only on a loopback endpoint" in r.stderr, r.stderr


def test_a_moto_this_checkout_did_not_start_is_refused_by_up_and_down(tmp_path: Path) -> None:
    """Another checkout's `make local` on the same port: neither up nor down of this checkout acts on it."""
    gptoss = str(Path(sys.executable).parent / "gptoss")
    other = MotoServer(tmp_path / "other.log")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GPTOSS_"))}
        env |= {"GPTOSS_STATE_DIR": str(tmp_path / "mine"), "GPTOSS_LOCAL_PORT": str(other.port)}
        import boto3

        cfn = boto3.client("cloudformation", endpoint_url=other.url, region_name="us-east-2", aws_access_key_id="testing",
                           aws_secret_access_key="testing")  # fmt: skip
        cfn.create_stack(StackName="GptOssLocalStack", TemplateBody='{"Resources": {"T": {"Type": "AWS::SNS::Topic"}}}')
        for action in ("up", "down"):
            r = subprocess.run([gptoss, "local", action], env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 2, (action, r.stderr)
            (line,) = r.stderr.strip().splitlines()
            assert f"moto on http://localhost:{other.port} was not started by this checkout's `make local`" in line, line
            assert "Fix: GPTOSS_LOCAL_PORT=PORT" in line and line.endswith(("Nothing was deployed.", "Nothing was removed.")), line
        stacks = [s["StackName"] for s in cfn.list_stacks()["StackSummaries"] if s["StackStatus"] != "DELETE_COMPLETE"]
        assert stacks == ["GptOssLocalStack"], "the other checkout's cluster is untouched"
    finally:
        other.stop()


def test_local_env_unset_gives_the_shell_back_what_it_had(tmp_path: Path) -> None:
    """A shell whose real region and keys were environment variables has them again after `--unset`, and
    what it did not have is unset; `local env` run twice keeps the first record."""
    script = "\n".join([
        'eval "$(.venv/bin/gptoss local env)"',
        'eval "$(.venv/bin/gptoss local env)"',
        'echo "during: $AWS_REGION $AWS_ACCESS_KEY_ID $AWS_ENDPOINT_URL"',
        'eval "$(.venv/bin/gptoss local env --unset)"',
        'echo "after: ${AWS_REGION-unset} ${AWS_ACCESS_KEY_ID-unset} ${AWS_SECRET_ACCESS_KEY-unset} ${AWS_ENDPOINT_URL-unset}"',
        'echo "record: ${GPTOSS_LOCAL_SAVED_ENV-unset}"',
    ])  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GPTOSS_LOCAL"))}
    env |= {"AWS_REGION": "eu-west-1", "AWS_ACCESS_KEY_ID": "AKIA EXAMPLE'KEY", "GPTOSS_LOCAL_PORT": "5099"}
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "during: us-east-2 testing http://localhost:5099" in r.stdout, r.stdout
    assert "after: eu-west-1 AKIA EXAMPLE'KEY unset unset" in r.stdout, r.stdout
    assert "record: unset" in r.stdout, r.stdout
