"""Staging at boot, run for real: NVMe striping, checkpoint and examples, verified and repaired.

The checkpoint arrives from a folder behind a fake `aws` (S3) or from the fake Hub on loopback
through the real huggingface_hub library (0.x, 1.x and 2.x, installed by `make setup` into
.hf-clients/). Every shard is a valid safetensors file, so the node's checks read real headers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from clusterspec.loading import load_config
from tests.conftest import ROOT, fake_command
from tests.fakes import hub

Shipped = Callable[[str], Path]
HF_CLIENTS = ROOT / ".hf-clients"
SHARDS = [f"model-{i:05d}-of-00002.safetensors" for i in range(3)]
SERVABLE = {*SHARDS, "config.json", "model.safetensors.index.json", "tokenizer.json"}


def _fake(bindir: Path, name: str, body: str) -> None:
    fake_command(bindir, name, body)


# ---- checkpoint, examples and caches ---------------------------------------------------------


@pytest.fixture
def artifacts_env(tmp_path: Path, shipped: Shipped) -> dict[str, str]:
    """A fake S3 (a folder) behind a fake `aws` that syncs like the real one, and a node's cluster.env."""
    s3, fakes, state = tmp_path / "s3", tmp_path / "fakes", tmp_path / "state"
    for d in (s3, fakes, state):
        d.mkdir()
    hub.make_checkpoint(s3 / "models" / "gpt-oss-120b", 3)
    ex = s3 / "models" / "vllm-neuron"
    sv = load_config({}).serving
    for rel in (sv.proxy.script, f"{sv.examples_dir}/{sv.schedule_helper}", f"{sv.examples_dir}/{sv.decode.schedule_file}"):
        (ex / rel).parent.mkdir(parents=True, exist_ok=True)
        (ex / rel).write_text("x")
    # `aws s3 sync [--exclude P]... SRC DST` copies what is missing or differs in size, as the CLI does.
    sync = (
        "import fnmatch, os, shutil, sys\n"
        "args = sys.argv[1:]; ex = [args[i + 1] for i, a in enumerate(args) if a == '--exclude']\n"
        "src, dst = args[-2].removeprefix('s3://'), args[-1]\n"
        f"root = os.path.join({str(s3)!r}, src)\n"
        "for d, _, names in os.walk(root):\n"
        "    for n in names:\n"
        "        rel = os.path.relpath(os.path.join(d, n), root)\n"
        "        if any(fnmatch.fnmatch(rel, p) for p in ex): continue\n"
        "        out = os.path.join(dst, rel)\n"
        "        if os.path.exists(out) and os.path.getsize(out) == os.path.getsize(os.path.join(d, n)): continue\n"
        "        os.makedirs(os.path.dirname(out), exist_ok=True); shutil.copy(os.path.join(d, n), out)\n"
        f"        open({str(state / 'copied.log')!r}, 'a').write(rel + '\\n')\n"
    )
    (fakes / "sync.py").write_text(sync)
    _fake(
        fakes,
        "aws",
        f'echo "aws $*" >>"{state}/calls.log"; echo "region=${{AWS_REGION:-}}/${{AWS_DEFAULT_REGION:-}}" >>"{state}/env.log"\n'
        f'if [ "$1" = secretsmanager ]; then echo hf_secretTOKENvalue1234567890; fi\n'
        f'if [ "$1 $2" = "s3 sync" ]; then shift 2; {sys.executable} "{fakes}/sync.py" "$@"; fi\n',
    )
    cluster_env = tmp_path / "cluster.env"
    cluster_env.write_text(
        "\n".join(
            [
                "AWS_REGION=us-east-2",
                f"GPTOSS_MODEL_DIR={tmp_path}/nvme/models/gpt-oss-120b",
                "GPTOSS_MODEL_SOURCE=s3",
                "GPTOSS_MODEL_ID=openai/gpt-oss-120b",
                "GPTOSS_MODEL_S3_URI=s3://models/gpt-oss-120b",
                "GPTOSS_MODEL_SHARDS=3",
                f"GPTOSS_EXAMPLES_DIR={tmp_path}/opt/vllm-neuron",
                "GPTOSS_EXAMPLES_REPO=https://github.com/vllm-project/vllm-neuron.git",
                "GPTOSS_EXAMPLES_REF=test-ref",
                "GPTOSS_EXAMPLES_S3_URI=s3://models/vllm-neuron",
                f"GPTOSS_PROXY_SCRIPT={sv.proxy.script}",
                f"GPTOSS_SCHEDULE_SUBDIR={sv.examples_dir}",
                f"GPTOSS_SCHEDULE_HELPER={sv.schedule_helper}",
                f"GPTOSS_SCHEDULE_FILE={sv.decode.schedule_file}",
                f"GPTOSS_CACHE_DIR={tmp_path}/nvme/cache",
                "GPTOSS_COMPILE_CACHE_S3_URI=",
                "GPTOSS_VENV_GLOB=/nonexistent*",
            ]
        )
        + "\n"
    )
    home = tmp_path / "home"
    home.mkdir()
    return {
        **os.environ,
        "PATH": f"{fakes}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(home),
        "GPTOSS_CLUSTER_ENV": str(cluster_env),
        "GPTOSS_RUN_DIR": str(tmp_path / "run"),
        "GPTOSS_SYSTEM_CACHE_LINK": str(tmp_path / "var-tmp-neuron-compile-cache"),
        "GPTOSS_RETRY_DELAY_S": "0",
        "GPTOSS_RETRIES": "3",
        "ROOT": str(tmp_path),
        "S3": str(s3),
        "SCRIPT": str(shipped("gptoss-stage-artifacts")),
        "CHECKPOINT": str(shipped("gptoss-checkpoint")),
    }


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([env["SCRIPT"]], env=env, capture_output=True, text=True, timeout=300)


def _set(env: dict[str, str], **values: str) -> None:
    """Change lines of the node's cluster.env (what a redeploy changes)."""
    f = Path(env["GPTOSS_CLUSTER_ENV"])
    lines = dict(line.split("=", 1) for line in f.read_text().splitlines())
    f.write_text("".join(f"{k}={v}\n" for k, v in (lines | values).items()))


def _copied(env: dict[str, str]) -> list[str]:
    log = Path(env["ROOT"]) / "state/copied.log"
    return log.read_text().splitlines() if log.exists() else []


def test_staging_seals_the_checkpoint_and_a_second_boot_downloads_nothing(artifacts_env: dict[str, str]) -> None:
    root = Path(artifacts_env["ROOT"])
    res = _run(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    model = root / "nvme/models/gpt-oss-120b"
    sealed = json.loads((model / ".gptoss-complete").read_text())
    assert sealed["source"] == "s3:s3://models/gpt-oss-120b"
    assert set(sealed["files"]) == SERVABLE and all(sealed["files"][f] == (model / f).stat().st_size for f in SERVABLE)
    assert not (root / "nvme/models/gpt-oss-120b.partial").exists()
    assert not (model / "original").exists() and not (model / "metal").exists()
    assert {p.name for p in model.iterdir()} == SERVABLE | {".gptoss-complete"}, "the servable files and the seal, nothing else"
    assert (root / "opt/vllm-neuron/.gptoss-source").read_text().strip() == "s3:s3://models/vllm-neuron"
    assert (root / "run/staged").exists(), "the servers' go-ahead"
    assert (Path(artifacts_env["HOME"]) / ".cache/neuron_libtorch").resolve() == root / "nvme/cache/neuron_libtorch"
    assert set((root / "state/env.log").read_text().split()) == {"region=us-east-2/us-east-2"}
    first = _copied(artifacts_env)
    assert sorted(f for f in first if not f.startswith("examples")) == sorted(SERVABLE)
    res = _run(artifacts_env)
    assert res.returncode == 0
    assert _copied(artifacts_env) == first, "a second boot copies nothing"
    assert "verified against its marker" in res.stdout


def test_a_truncated_shard_is_repaired_at_boot_and_only_it_is_fetched_again(artifacts_env: dict[str, str]) -> None:
    root = Path(artifacts_env["ROOT"])
    assert _run(artifacts_env).returncode == 0
    shard = root / "nvme/models/gpt-oss-120b" / SHARDS[1]
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size // 3)
    before = len(_copied(artifacts_env))
    res = _run(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "cannot be served as it is: repairing" in res.stdout and f"removed the damaged {SHARDS[1]}" in res.stdout
    assert _copied(artifacts_env)[before:] == [SHARDS[1]]
    assert shard.stat().st_size == size


def test_a_deleted_shard_and_a_lost_marker_are_caught_too(artifacts_env: dict[str, str]) -> None:
    root = Path(artifacts_env["ROOT"])
    model = root / "nvme/models/gpt-oss-120b"
    assert _run(artifacts_env).returncode == 0
    (model / SHARDS[2]).unlink()
    assert _run(artifacts_env).returncode == 0 and (model / SHARDS[2]).exists()
    (model / ".gptoss-complete").unlink()  # a crash between the download and the seal
    res = _run(artifacts_env)
    assert res.returncode == 0 and (model / ".gptoss-complete").exists()
    assert "cannot be served as it is" in res.stdout


def test_a_changed_model_source_stages_everything_again(artifacts_env: dict[str, str]) -> None:
    assert _run(artifacts_env).returncode == 0
    shutil.copytree(Path(artifacts_env["S3"]) / "models/gpt-oss-120b", Path(artifacts_env["S3"]) / "other/gpt-oss-120b")
    before = len(_copied(artifacts_env))
    _set(artifacts_env, GPTOSS_MODEL_S3_URI="s3://other/gpt-oss-120b")
    res = _run(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(_copied(artifacts_env)[before:]) == sorted(SERVABLE)
    sealed = json.loads((Path(artifacts_env["ROOT"]) / "nvme/models/gpt-oss-120b/.gptoss-complete").read_text())
    assert sealed["source"] == "s3:s3://other/gpt-oss-120b"


def test_an_incomplete_checkpoint_is_never_moved_into_place(artifacts_env: dict[str, str]) -> None:
    root = Path(artifacts_env["ROOT"])
    (Path(artifacts_env["S3"]) / "models/gpt-oss-120b" / SHARDS[1]).unlink()
    res = _run(artifacts_env)
    assert res.returncode != 0
    assert f"{SHARDS[1]}: missing" in res.stderr
    assert not (root / "nvme/models/gpt-oss-120b").exists()
    assert not (root / "run/staged").exists(), "the servers keep waiting; the unit retries with back-off"


def test_a_shard_whose_header_lies_about_its_size_is_refused(artifacts_env: dict[str, str]) -> None:
    shard = Path(artifacts_env["S3"]) / "models/gpt-oss-120b" / SHARDS[0]
    shard.write_bytes(shard.read_bytes() + b"\0" * 7)
    res = _run(artifacts_env)
    assert res.returncode != 0 and f"{SHARDS[0]}: " in res.stderr and "its header describes" in res.stderr


def test_existing_cache_directories_move_onto_nvme(artifacts_env: dict[str, str]) -> None:
    home, root = Path(artifacts_env["HOME"]), Path(artifacts_env["ROOT"])
    (home / ".cache/vllm").mkdir(parents=True)
    (home / ".cache/vllm/old-graph.neff").write_text("compiled")
    res = _run(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (home / ".cache/vllm").is_symlink()
    assert (root / "nvme/cache/vllm/old-graph.neff").read_text() == "compiled"
    assert not (root / "nvme/cache/vllm/vllm").exists()
    assert _run(artifacts_env).returncode == 0  # a second boot keeps the links


@pytest.fixture
def fake_hub(artifacts_env: dict[str, str]) -> Callable[..., hub.Hub]:
    """The fake Hub on loopback serving the checkpoint folder, with optional faults."""
    started = []

    def start(**faults: object) -> hub.Hub:
        server, state = hub.serve(Path(artifacts_env["S3"]) / "models", **faults)  # type: ignore[arg-type]
        (Path(artifacts_env["S3"]) / "models" / "openai").mkdir(exist_ok=True)
        os.symlink(Path(artifacts_env["S3"]) / "models" / "gpt-oss-120b", Path(artifacts_env["S3"]) / "models" / "openai" / "gpt-oss-120b")
        artifacts_env["HF_ENDPOINT"] = f"http://127.0.0.1:{server.server_address[1]}"
        started.append(server)
        return state

    yield start  # type: ignore[misc]
    for s in started:
        s.shutdown()


def _hf_venv(artifacts_env: dict[str, str], version: str) -> None:
    """A stand-in for the DLAMI's vLLM venv whose Python has one real huggingface_hub release."""
    client = HF_CLIENTS / version
    assert client.is_dir(), f"{client} is missing: `make setup` installs the huggingface_hub releases the tests use"
    venv = Path(artifacts_env["ROOT"]) / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/activate").write_text(
        f'export VIRTUAL_ENV={venv}\nexport PATH="{Path(sys.executable).parent}:$PATH"\nexport PYTHONPATH={client}\n'
        "export HF_HUB_DISABLE_TELEMETRY=1\n"
    )
    _set(artifacts_env, GPTOSS_MODEL_SOURCE="huggingface", GPTOSS_VENV_GLOB=f"{venv}*",
         GPTOSS_HF_TOKEN_SECRET_ARN="arn:aws:secretsmanager:us-east-2:123456789012:secret:hf-token-AbCdEf")  # fmt: skip
    artifacts_env["HF_HOME"] = str(Path(artifacts_env["ROOT"]) / "hf-home")


@pytest.mark.parametrize("version", ["0.36.2", "1.33.0", "2.4.0"])
def test_hugging_face_download_through_the_real_library_fetches_only_the_servable_files(
    artifacts_env: dict[str, str], fake_hub: Callable[..., hub.Hub], version: str
) -> None:
    """huggingface_hub.snapshot_download against a local Hub: no original/ or metal/ (in 1.x the CLI's --exclude broke this)."""
    state = fake_hub()
    _hf_venv(artifacts_env, version)
    res = _run(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(state.downloads) == sorted(SERVABLE)
    model = Path(artifacts_env["ROOT"]) / "nvme/models/gpt-oss-120b"
    assert {p.name for p in model.iterdir() if not p.name.startswith(".")} == SERVABLE
    assert json.loads((model / ".gptoss-complete").read_text())["source"] == "huggingface:openai/gpt-oss-120b"
    calls = [c for c in (Path(artifacts_env["ROOT"]) / "state/calls.log").read_text().splitlines() if " s3 " not in f" {c} " and "configure" not in c]
    assert calls == ["aws secretsmanager get-secret-value --secret-id arn:aws:secretsmanager:us-east-2:123456789012:secret:hf-token-AbCdEf "
                     "--query SecretString --output text"]  # fmt: skip
    on_disk = subprocess.run(["grep", "-rl", "hf_secretTOKEN", str(Path(artifacts_env["ROOT"]) / "nvme")], capture_output=True)
    assert on_disk.stdout == b"", "the token never reaches the disk"


def test_the_token_reaches_the_download_process_and_no_other_child(artifacts_env: dict[str, str], fake_hub: Callable[..., hub.Hub]) -> None:
    """Every program the staging runs is recorded with whether HF_TOKEN is in its environment or argv."""
    fake_hub()
    _hf_venv(artifacts_env, "1.33.0")
    root = Path(artifacts_env["ROOT"])
    shims, seen = root / "shims", root / "children.log"
    python_dir = Path(sys.executable).parent
    for name in ("python3", "git", "aws", "sync", "s5cmd", "mkdir", "mv", "rm", "cp", "ln", "touch"):
        real = shutil.which(name, path=os.pathsep.join([str(Path(artifacts_env["PATH"].split(os.pathsep)[0])), str(python_dir), os.environ["PATH"]]))
        if real:
            fake_command(shims, name, f'echo "{name} env=${{HF_TOKEN:+token}} args=$(echo "$*" | grep -c hf_secretTOKEN)" >>"{seen}"\nexec "{real}" "$@"\n')
    activate = root / "venv-vllm/bin/activate"
    activate.write_text(activate.read_text() + f'export PATH="{shims}:$PATH"\n')
    env = artifacts_env | {"PATH": f"{shims}{os.pathsep}{artifacts_env['PATH']}"}
    res = _run(env)
    assert res.returncode == 0, res.stdout + res.stderr
    children = seen.read_text().splitlines()
    with_token = [c for c in children if "env=token" in c]
    assert with_token == ["python3 env=token args=0"], with_token
    assert len(children) > 10 and all(c.endswith("args=0") for c in children), "never in an argv"
    assert "hf_secretTOKEN" not in res.stdout + res.stderr


@pytest.mark.parametrize("version", ["0.36.2", "2.4.0"])
def test_a_download_cut_half_way_is_resumed_and_never_leaves_a_partial_checkpoint_in_place(
    artifacts_env: dict[str, str], fake_hub: Callable[..., hub.Hub], version: str
) -> None:
    state = fake_hub(fail_file=SHARDS[1], fail_times=1)
    _hf_venv(artifacts_env, version)
    res = _run(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    model = Path(artifacts_env["ROOT"]) / "nvme/models/gpt-oss-120b"
    assert state.fail_left == 0 and state.downloads.count(SHARDS[1]) == 1
    sealed = json.loads((model / ".gptoss-complete").read_text())
    assert sealed["files"][SHARDS[1]] == (Path(artifacts_env["S3"]) / "models/gpt-oss-120b" / SHARDS[1]).stat().st_size


def test_a_hub_that_keeps_failing_leaves_no_checkpoint_and_no_go_ahead(artifacts_env: dict[str, str], fake_hub: Callable[..., hub.Hub]) -> None:
    fake_hub(fail_file=SHARDS[0], fail_times=100)
    _hf_venv(artifacts_env, "0.36.2")
    res = _run(artifacts_env)
    assert res.returncode != 0 and "failed 3 times; giving up" in res.stdout
    root = Path(artifacts_env["ROOT"])
    assert not (root / "nvme/models/gpt-oss-120b").exists() and not (root / "run/staged").exists()


def _upstream(artifacts_env: dict[str, str], tmp_path: Path) -> tuple[Path, list[str]]:
    """A real git repository of the examples with one commit tagged test-ref: (its path, git -C it)."""
    repo = tmp_path / "vllm-neuron-upstream"
    shutil.copytree(Path(artifacts_env["S3"]) / "models/vllm-neuron", repo)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "release"], check=True)
    subprocess.run([*git, "tag", "test-ref"], check=True)
    return repo, git


def test_examples_are_fetched_at_the_pinned_ref_and_a_new_ref_restages_them(artifacts_env: dict[str, str], tmp_path: Path) -> None:
    """A real git repository with a tag and a later commit: the node checks out the tagged one."""
    repo, git = _upstream(artifacts_env, tmp_path)
    (repo / "LATER").write_text("in the next release")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "later"], check=True)
    subprocess.run([*git, "tag", "next-ref"], check=True)
    _set(artifacts_env, GPTOSS_EXAMPLES_S3_URI="", GPTOSS_EXAMPLES_REPO=str(repo))
    res = _run(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    dest = Path(artifacts_env["ROOT"]) / "opt/vllm-neuron"
    assert (dest / load_config({}).serving.proxy.script).is_file() and not (dest / "LATER").exists()
    assert (dest / ".gptoss-source").read_text().strip() == f"git:{repo}@test-ref"
    _set(artifacts_env, GPTOSS_EXAMPLES_REF="next-ref")
    assert _run(artifacts_env).returncode == 0
    assert (dest / "LATER").exists() and (dest / ".gptoss-source").read_text().strip() == f"git:{repo}@next-ref"


# ---- pins: the model by Hub commit, the examples by git commit ----------------------------------

OLD = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def moved_hub(artifacts_env: dict[str, str], tmp_path: Path) -> Callable[..., tuple[hub.Hub, Path, Path]]:
    """A Hub whose main (hub.COMMIT) changed a shard since the commit OLD: (hub, main's repo, OLD's repo)."""
    started = []

    def start(**faults: object) -> tuple[hub.Hub, Path, Path]:
        main = Path(artifacts_env["S3"]) / "models"
        old = tmp_path / "hub-at-old"
        hub.make_checkpoint(old / "openai" / "gpt-oss-120b", 3)
        hub.write_safetensors(main / "gpt-oss-120b" / SHARDS[0], {"layer0.weight": 4096})  # upstream re-published a shard
        server, state = hub.serve(main, revisions={OLD: old}, **faults)  # type: ignore[arg-type]
        (main / "openai").mkdir(exist_ok=True)
        os.symlink(main / "gpt-oss-120b", main / "openai" / "gpt-oss-120b")
        artifacts_env["HF_ENDPOINT"] = f"http://127.0.0.1:{server.server_address[1]}"
        started.append(server)
        return state, main / "gpt-oss-120b", old / "openai" / "gpt-oss-120b"

    yield start  # type: ignore[misc]
    for s in started:
        s.shutdown()


@pytest.mark.parametrize("version", ["0.36.2", "2.4.0"])
def test_a_pinned_model_revision_is_what_a_node_stages_after_upstream_moved(
    artifacts_env: dict[str, str], moved_hub: Callable[..., tuple[hub.Hub, Path, Path]], version: str
) -> None:
    """A node replaced after the Hub's main changed still stages the pinned commit, and seals it."""
    _, main, old = moved_hub()
    _hf_venv(artifacts_env, version)
    _set(artifacts_env, GPTOSS_MODEL_REVISION=OLD)
    res = _run(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    model = Path(artifacts_env["ROOT"]) / "nvme/models/gpt-oss-120b"
    assert (model / SHARDS[0]).read_bytes() == (old / SHARDS[0]).read_bytes() != (main / SHARDS[0]).read_bytes()
    assert json.loads((model / ".gptoss-complete").read_text())["source"] == f"huggingface:openai/gpt-oss-120b@{OLD}"
    # The operator moves the pin to main's commit: the node restages (its copy is of another commit).
    _set(artifacts_env, GPTOSS_MODEL_REVISION=hub.COMMIT)
    res = _run(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (model / SHARDS[0]).read_bytes() == (main / SHARDS[0]).read_bytes()
    assert json.loads((model / ".gptoss-complete").read_text())["source"] == f"huggingface:openai/gpt-oss-120b@{hub.COMMIT}"


def test_a_hub_that_answers_with_another_commit_is_refused(
    artifacts_env: dict[str, str], moved_hub: Callable[..., tuple[hub.Hub, Path, Path]]
) -> None:
    """The Hub serves main whatever revision is asked: nothing is sealed, nothing is served, and the log says why."""
    moved_hub(ignore_revision=True)
    _hf_venv(artifacts_env, "1.33.0")
    _set(artifacts_env, GPTOSS_MODEL_REVISION=OLD)
    res = _run(artifacts_env)
    assert res.returncode != 0
    assert f"refused (the Hub answered with another commit): {SHARDS[0]}: from {hub.COMMIT}, not the pinned {OLD}" in res.stderr
    root = Path(artifacts_env["ROOT"])
    assert not (root / "nvme/models/gpt-oss-120b").exists() and not (root / "run/staged").exists()


def test_examples_whose_tag_moved_off_the_pinned_commit_are_refused(artifacts_env: dict[str, str], tmp_path: Path) -> None:
    """The tag is re-pointed upstream at a later commit: a node pinned to the first refuses it, by name."""
    repo, git = _upstream(artifacts_env, tmp_path)
    pinned = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    _set(artifacts_env, GPTOSS_EXAMPLES_S3_URI="", GPTOSS_EXAMPLES_REPO=str(repo), GPTOSS_EXAMPLES_COMMIT=pinned)
    res = _run(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    dest = Path(artifacts_env["ROOT"]) / "opt/vllm-neuron"
    assert (dest / ".gptoss-source").read_text().strip() == f"git:{repo}@test-ref#{pinned}"
    assert f"examples at test-ref: commit {pinned}" in res.stdout
    # Upstream moves the tag; a new node (nothing on its disk) must not take the new commit.
    (repo / "LATER").write_text("not what the fleet runs")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "later"], check=True)
    subprocess.run([*git, "tag", "-f", "test-ref"], check=True, capture_output=True)
    moved = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    shutil.rmtree(dest)
    res = _run(artifacts_env)
    assert res.returncode != 0
    assert f"refused: test-ref of {repo} is now commit {moved}, not the pinned {pinned} (the tag moved upstream)" in res.stdout
    assert not dest.exists() and not Path(str(dest) + ".partial").exists()
