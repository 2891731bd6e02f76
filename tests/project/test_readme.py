"""Every command the README shows works as written on a checkout.

```bash blocks need no AWS account: each command runs and must succeed. ```console blocks
need an account: each `gptoss` subcommand answers `--help` and each make target dry-runs
(`make -n`). ```text blocks of `-c` parameters (README and docs/) are parsed by `gptoss plan`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, gptoss_in_process

README = (ROOT / "README.md").read_text()


def blocks(language: str, text: str = README) -> list[list[str]]:
    """Each block of that language as its commands (continuations joined, comments dropped)."""
    out = []
    for body in re.findall(rf"```{language}\n(.*?)```", text, re.S):
        commands = []
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
        out.append(commands)
    return out


def offline_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    # TMPDIR: a command that writes a scratch file (the README's diagram) writes it in this test's own directory.
    return env | {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(tmp / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "none"),
                  "TMPDIR": str(tmp), "CDK_OUT": str(tmp / "cdk.out")}  # fmt: skip


def state_env(tmp: Path) -> dict[str, str]:
    # The runbook's later lines name the stack its `make deploy` recorded: the record it writes.
    state = tmp / "gptoss-state"
    state.mkdir(exist_ok=True)
    (state / "deployed.json").write_text(json.dumps({"GptOss8k1kProd": {"context": ["config=examples/production-3p8d.yaml"]}}))
    return offline_env(tmp) | {"GPTOSS_STATE_DIR": str(state)}


def run(command: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=state_env(tmp), capture_output=True, text=True, timeout=600)


def gptoss(argv: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    """`.venv/bin/gptoss ARGV` with run()'s environment, in this process (the entry point's main: what the
    command says is what is checked; an offline block's `gptoss` line keeps its shell and process)."""
    return gptoss_in_process(*argv, env=state_env(tmp), cwd=ROOT)


# The README and the operations page it sends a user to: every command either shows works as written.
RUNBOOKS = [README, (ROOT / "docs" / "operations.md").read_text()]
OFFLINE = list(dict.fromkeys(c for text in RUNBOOKS for b in blocks("bash", text) for c in b))
ONLINE = list(dict.fromkeys(c for text in RUNBOOKS for b in blocks("console", text) for c in b))


def test_the_readme_shows_commands_of_both_kinds() -> None:
    assert "make synth" in OFFLINE and "make test" in OFFLINE
    assert any(c.startswith(".venv/bin/gptoss preflight") for c in ONLINE)


@pytest.mark.parametrize("command", [c for c in OFFLINE if c != "make test"])
def test_offline_commands_run_as_written(command: str, tmp_path: Path) -> None:
    r = run(command, tmp_path)
    assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    # Quiet: no jsii frame printed before a warning, no feature-flag notice, no traceback.
    noise = [w for w in ("program.js:", "feature flags are not configured", "Traceback") if w in r.stdout + r.stderr]
    assert noise == [], (command, noise)


def test_make_test_is_what_ci_runs(tmp_path: Path) -> None:
    """`make test` itself is this suite: its recipe must parse, and .ci/run must call it."""
    assert run("make -n test", tmp_path).returncode == 0
    assert "\nmake test\n" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("command", [c for c in ONLINE if not c.startswith("export ")])
def test_commands_that_need_aws_exist_as_written(command: str, tmp_path: Path) -> None:
    words = shlex.split(command)
    if words[0] == ".venv/bin/gptoss":
        r = gptoss([words[1], "--help"], tmp_path)
        assert r.returncode == 0 and r.stdout.startswith("usage: gptoss"), r.stderr
        # Its options are its own (the parser takes them) ...
        from cluster_ops.cli import build_parser

        args, extra = build_parser().parse_known_args(words[1:])
        assert extra == [] or getattr(args, "passthrough", False), (command, extra)
        # ... and the cluster they name is a valid one (everything but talking to AWS).
        params = [a for c in (args.context or []) for a in ("-c", c)] + (["--stack", args.stack] if args.stack else [])
        r = gptoss(["plan", *params], tmp_path)
        assert r.returncode == 0, (command, r.stderr[-2000:])
    elif words[:2] == ["npx", "cdk"]:
        # Run verbatim against the local AWS by tests/lifecycle/test_cdk_as_typed.py (its own list checks it reads these).
        from tests.lifecycle.test_cdk_as_typed import readme_cdk_lines

        assert command in readme_cdk_lines(), command
    elif words[0] == "aws":
        # The AWS CLI reads an output of the default stack: one the synthesized template has (its snapshot).
        snapshot = json.loads((ROOT / "tests" / "stacks" / "__snapshots__" / "test_template" / "test_template_snapshot.json").read_text())
        (key,) = re.findall(r"OutputKey=='(\w+)'", command)
        assert words[1:3] == ["cloudformation", "describe-stacks"] and key in snapshot["Outputs"], (command, sorted(snapshot["Outputs"]))
        assert f"--stack-name {snapshot.get('StackName', 'GptOss8k1kStack')}" in command, command
    else:
        assert words[0] == "make", command
        r = run(shlex.join(["make", "-n", *words[1:]]), tmp_path)
        assert r.returncode == 0, (command, r.stderr[-2000:])


DOCS = [README, *((p.read_text()) for p in sorted((ROOT / "docs").glob("*.md")))]
PARAMETER_LINES = [c for text in DOCS for b in blocks("text", text) for c in b if c.startswith("-c ")]


def test_the_docs_show_parameter_examples() -> None:
    assert len(PARAMETER_LINES) >= 2, "the docs' ```text blocks of -c parameters (docs/design.md)"


@pytest.mark.parametrize("line", PARAMETER_LINES)
def test_parameter_examples_are_accepted(line: str, tmp_path: Path) -> None:
    r = gptoss(["plan", *shlex.split(line)], tmp_path)
    assert r.returncode == 0, (line, r.stderr[-2000:])


def _uncommented(text: str) -> str:
    """An example with its commented-out settings (`# key: value`, indented alike) switched on."""
    return "\n".join(re.sub(r"^# ?((?: {2})*[a-z_]+:(?: |$))", r"\1", line) for line in text.splitlines()) + "\n"


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_every_example_is_accepted_as_shipped_and_with_its_commented_settings_on(example: str, tmp_path: Path) -> None:
    text = (ROOT / "examples" / example).read_text()
    for variant, body in (("as shipped", text), ("commented settings on", _uncommented(text))):
        path = tmp_path / example
        path.write_text(body)
        r = gptoss(["plan", "-c", f"config={path}"], tmp_path)
        assert r.returncode == 0, (example, variant, r.stderr[-2000:])


def test_every_relative_link_of_the_readme_and_docs_names_a_file_of_the_checkout() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for doc in docs:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)}: {target} does not exist"


def test_no_number_placeholder_is_left_in_the_docs() -> None:
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert not re.findall(r"@[A-Z_]+@", doc.read_text()), doc.name


def test_every_pointer_from_the_code_to_a_section_of_the_docs_names_one() -> None:
    """Messages and docstrings say where to read on ("docs/design.md 'Capacity'"): each such section exists."""
    pointers = set()
    for package in ("clusterspec", "cluster_ops", "cluster_constructs", "stacks"):
        for path in (ROOT / package).rglob("*.py"):
            pointers |= set(re.findall(r"(README|docs/[a-z]+\.md) '([^']+)'", path.read_text()))
    assert len(pointers) >= 5
    for doc, title in sorted(pointers):
        text = (ROOT / ("README.md" if doc == "README" else doc)).read_text()
        assert re.search(rf"^#+ {re.escape(title)}$|^\*\*{re.escape(title)}\.\*\*", text, re.M), f"{doc} has no section '{title}'"


def _numbers(text: str) -> set[str]:
    """The numbers a text states in its prose: fenced blocks, inline code and link targets left out."""
    prose = re.sub(r"```.*?```", " ", text, flags=re.S)
    prose = re.sub(r"`[^`]*`", " ", prose)
    prose = re.sub(r"\]\([^)]*\)", "]", prose)
    return {n.rstrip(",") for n in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\d])", prose)}


def test_every_number_the_readme_states_is_one_the_docs_hold() -> None:
    """The README quotes no measurement of its own: a number in its prose is one docs/ states too (where it has its
    date and conditions), so the two cannot drift apart."""
    docs = " ".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    held = _numbers(docs) | set(re.findall(r"\d[\d,.]*\d|\d", docs))
    missing = sorted(n for n in _numbers(README) if n not in held)
    assert missing == [], f"README.md states {missing}, which no document of docs/ holds: link to the document instead"


def test_the_number_check_catches_a_number_docs_do_not_hold() -> None:
    assert {"4,505", "0.92", "517"} <= _numbers("CI took 4,505 s; the gate 0.92x; served again after 517 s (`make 999`).")
    assert "999" not in _numbers("`make 999`")


def test_the_readme_is_a_door_of_at_most_150_lines() -> None:
    """What it is, the two commands, deploy, the first request, change and destroy, the documents: no more."""
    assert len(README.splitlines()) <= 150, "move detail to docs/ (operations.md, benchmarks.md, verification.md)"
    headings = re.findall(r"^## (.+)$", README, re.M)
    for h in ("Two commands", "Deploy to AWS", "Send your first request", "Change and destroy", "Documents"):
        assert h in headings, (h, headings)
