"""The compile cache end to end: each node identity uploads to its own area, its replacements restore
it, the operator promotes uploads to the fleet's cache, and a node restores only what a manifest verifies.

The node's scripts run as shipped with the real AWS CLI (v1, the nodes' own; `make setup` puts it
in .aws-cli/) against a moto server on loopback, each node with the credentials of its instance
role session. The promotion is cluster_ops.cache with boto3, as `gptoss save-cache` runs it with
the operator's credentials. (moto does not evaluate IAM: that a node can write only its own area
is asserted on the template, tests/stacks/least_privilege.py.)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest

from cluster_ops import cache
from clusterspec.loading import load_config
from node_render.render import cluster_env
from tests.conftest import real_aws_cli
from tests.fakes import hub

Shipped = Callable[[str], Path]
BUCKET = "gptoss-cache"
CACHE = f"s3://{BUCKET}/neuron/2.33"
CFG = load_config({"decode_instances": "2", "compile_cache_s3_uri": CACHE, "model": {"source": "s3", "s3_uri": f"s3://{BUCKET}/models/gpt-oss-120b"},
                   "examples": {"s3_uri": f"s3://{BUCKET}/models/vllm-neuron"}})  # fmt: skip
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-2"}


@pytest.fixture
def cloud(moto_url: str, tmp_path: Path) -> dict[str, Any]:
    """A reset moto with the cache bucket and an instance role; `node(instance id)` gives that node's environment."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST"), timeout=10)
    kw = {"endpoint_url": moto_url, "region_name": "us-east-2", "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    s3 = boto3.client("s3", **kw)
    s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
    role = boto3.client("iam", **kw).create_role(RoleName="gptoss-node", AssumeRolePolicyDocument="{}")["Role"]
    sts = boto3.client("sts", **kw)
    bindir = tmp_path / "bin"
    real_aws_cli(bindir)

    def node(name: str, instance_id: str, cache_dir: Path, image: str = "sdk-2.21") -> dict[str, str]:
        """The environment of node identity `name` running on instance `instance_id` of `image` (its venv's toolchain)."""
        c = sts.assume_role(RoleArn=role["Arn"], RoleSessionName=instance_id)["Credentials"]
        env_file = tmp_path / f"{instance_id}.env"
        node = next(n for n in CFG.layout.nodes if n.name == name)
        venv = _venv(tmp_path / "images" / image, IMAGES[image])
        values = cluster_env(CFG, node) | {"GPTOSS_CACHE_DIR": str(cache_dir), "GPTOSS_VENV_GLOB": f"{venv.parent}/venv*"}
        env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items() if "'" not in v and " " not in v))
        deploy = tmp_path / f"{instance_id}.deploy.env"
        deploy.write_text(f"GPTOSS_COMPILE_CACHE_URI={CACHE}\n")
        home = tmp_path / f"home-{instance_id}"
        home.mkdir(exist_ok=True)
        return {**os.environ, **CREDS, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "HOME": str(home), "AWS_ENDPOINT_URL": moto_url,
                "AWS_ACCESS_KEY_ID": c["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": c["SecretAccessKey"], "AWS_SESSION_TOKEN": c["SessionToken"],
                "GPTOSS_CLUSTER_ENV": str(env_file), "GPTOSS_DEPLOY_ENV": str(deploy)}  # fmt: skip

    return {"s3": s3, "node": node, "url": moto_url}


# Two images' vLLM venvs: the SDK 2.21 one, and the next, whose compiler differs (the rest is the same).
IMAGES = {
    "sdk-2.21": ["neuronx_cc-2.21.33.0", "torch_neuronx-2.8.0.2.10", "vllm_neuron-0.2.0", "vllm-0.10.2", "requests-2.32.3"],
    "sdk-2.22": ["neuronx_cc-2.22.12.0", "torch_neuronx-2.8.0.2.10", "vllm_neuron-0.2.0", "vllm-0.10.2", "requests-2.32.3"],
}
# Their toolchain keys (trn3.48xlarge, the default instance type; the hash of the versions above).
KEY = "trn3.48xlarge-18ec40e3d30ce888"
KEY_NEXT = "trn3.48xlarge-560995b207e02744"


def _venv(image: Path, dists: list[str]) -> Path:
    venv = image / "venv-vllm"
    for d in dists:
        (venv / "lib" / "python3.10" / "site-packages" / f"{d}.dist-info").mkdir(parents=True, exist_ok=True)
    return venv


def _compiled(root: Path, graphs: dict[str, bytes]) -> Path:
    for rel, data in graphs.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / ".gptoss-restored").touch()  # the node's own marker: never uploaded
    return root


def _save(shipped: Shipped, env: dict[str, str]) -> str:
    shipped("gptoss-cache-manifest")
    res = subprocess.run([str(shipped("gptoss-save-cache"))], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def _stage_new_node(cloud: dict[str, Any], root: Path, shipped: Shipped, name: str, instance_id: str, image: str = "sdk-2.21") -> subprocess.CompletedProcess[str]:
    """A new instance of node `name` stages for real: the checkpoint and the examples from S3, then the compile cache."""
    s3 = cloud["s3"]
    hub.make_checkpoint(root / "ckpt", 3)
    for p in (root / "ckpt").rglob("*"):
        if p.is_file():
            s3.upload_file(str(p), BUCKET, f"models/gpt-oss-120b/{p.relative_to(root / 'ckpt')}")
    sv = CFG.serving
    for rel in (sv.proxy.script, f"{sv.examples_dir}/{sv.schedule_helper}", f"{sv.examples_dir}/{sv.decode.schedule_file}"):
        s3.put_object(Bucket=BUCKET, Key=f"models/vllm-neuron/{rel}", Body=b"x")
    env = cloud["node"](name, instance_id, root / "cache", image)
    with Path(env["GPTOSS_CLUSTER_ENV"]).open("a") as f:
        f.write(f"GPTOSS_MODEL_DIR={root}/models/gpt-oss-120b\nGPTOSS_MODEL_SHARDS=3\nGPTOSS_EXAMPLES_DIR={root}/examples\n")
    env |= {"GPTOSS_RUN_DIR": str(root / "run"), "GPTOSS_SYSTEM_CACHE_LINK": str(root / "var-tmp-cache"), "GPTOSS_RETRY_DELAY_S": "0"}
    for name in ("gptoss-checkpoint", "gptoss-cache-manifest"):
        shipped(name)
    res = subprocess.run([str(shipped("gptoss-stage-artifacts"))], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


PREFILL = {"neuron-compile-cache/neuronxcc-2.33/MODULE_prefill/model.neff": b"prefill graph" * 100, "vllm/prefill.json": b"{}"}
DECODE = {"neuron-compile-cache/neuronxcc-2.33/MODULE_decode/model.neff": b"decode graph" * 100, "vllm/decode.json": b"{}"}


def _restored(cache_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(cache_dir).as_posix(): p.read_bytes() for p in cache_dir.rglob("*") if p.is_file() and not p.name.startswith(".gptoss-")}


def test_each_node_uploads_to_its_own_area_and_nothing_reaches_the_fleet_until_promoted(cloud: dict[str, Any], tmp_path: Path, shipped: Shipped) -> None:
    out = _save(shipped, cloud["node"]("prefill-0", "i-0aaaaaaaaaaaaaaaa", _compiled(tmp_path / "a", PREFILL)))
    area = f"neuron/2.33/nodes/prefill-0/{KEY}/"
    assert f"2 files of {tmp_path / 'a'} -> s3://{BUCKET}/{area.rstrip('/')} (trn3.48xlarge: neuronx-cc 2.21.33.0, torch-neuronx 2.8.0.2.10, vllm 0.10.2, vllm-neuron 0.2.0)" in out
    keys = sorted(o["Key"] for o in cloud["s3"].list_objects_v2(Bucket=BUCKET)["Contents"])
    assert keys == sorted([f"{area}manifest.json", *(f"{area}files/{rel}" for rel in PREFILL)]), "no marker, nothing outside its area"
    manifest = json.loads(cloud["s3"].get_object(Bucket=BUCKET, Key=f"{area}manifest.json")["Body"].read())
    assert manifest == {"files": {rel: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)} for rel, data in PREFILL.items()}}


def test_a_replacement_restores_its_own_identitys_upload_and_no_other_nodes(cloud: dict[str, Any], tmp_path: Path, shipped: Shipped) -> None:
    """prefill-0's instance is replaced: the new instance restores what prefill-0 saved (verified), and
    before any promotion a node of another identity restores nothing of it."""
    _save(shipped, cloud["node"]("prefill-0", "i-0aaaaaaaaaaaaaaaa", _compiled(tmp_path / "a", PREFILL)))
    # What a tampered object in the area looks like: dropped by the manifest's check.
    rel = "vllm/prefill.json"
    cloud["s3"].put_object(Bucket=BUCKET, Key=f"neuron/2.33/nodes/prefill-0/{KEY}/files/{rel}", Body=b"[]")
    res = _stage_new_node(cloud, tmp_path / "replacement", shipped, "prefill-0", "i-0ffffffffffffffff")
    assert _restored(tmp_path / "replacement" / "cache") == {k: v for k, v in PREFILL.items() if k != rel}
    assert f"compile cache restored from {CACHE}/nodes/prefill-0/{KEY} (this node's own, saved before)" in res.stdout
    assert f"dropped {rel}: its sha256 or size differs from the manifest" in res.stdout
    other = _stage_new_node(cloud, tmp_path / "other", shipped, "decode-1", "i-0dddddddddddddddd")
    assert f"no compile cache in {CACHE}/fleet/{KEY} (the fleet's, promoted by an operator) yet" in other.stdout
    assert f"no compile cache in {CACHE}/nodes/decode-1/{KEY} (this node's own, saved before) yet" in other.stdout
    assert _restored(tmp_path / "other" / "cache") == {}, "no other node's upload is restored"


def test_a_save_when_serving_waits_for_the_servers_and_uploads_once(cloud: dict[str, Any], tmp_path: Path, shipped: Shipped) -> None:
    """gptoss-cache-save.service at boot: once every server answers, upload; the next boot with the same cache uploads nothing."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        up = False

        def do_GET(self) -> None:
            self.send_response(200 if Health.up else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    health = tmp_path / "health"
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    health.write_text(f"gptoss-scripts.service - -\ngptoss-prefill@0.service {url} prefill_0\ngptoss-proxy.service http://127.0.0.1:9/healthcheck proxy\n")
    env = cloud["node"]("prefill-0", "i-0aaaaaaaaaaaaaaaa", _compiled(tmp_path / "a", PREFILL)) | {
        "GPTOSS_HEALTH_FILE": str(health), "GPTOSS_SAVE_WAIT_S": "30", "GPTOSS_SAVE_POLL_S": "1"}
    shipped("gptoss-cache-manifest")
    proc = subprocess.Popen([str(shipped("gptoss-save-cache")), "--when-serving"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        import time

        time.sleep(3)
        assert proc.poll() is None, "it waits while a server does not answer (the proxy's route is not a server's)"
        assert "Contents" not in cloud["s3"].list_objects_v2(Bucket=BUCKET, Prefix="neuron/2.33/nodes/"), "nothing uploaded yet"
        Health.up = True
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "2 files of" in out, out
        again = subprocess.run([str(shipped("gptoss-save-cache")), "--when-serving"], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "already holds this node's 2 files; nothing to upload" in again.stdout, again.stdout + again.stderr
    finally:
        proc.kill()
        server.shutdown()


def test_promotion_merges_the_chosen_uploads_and_a_new_node_restores_what_the_manifest_verifies(
    cloud: dict[str, Any], tmp_path: Path, shipped: Shipped
) -> None:
    _save(shipped, cloud["node"]("prefill-0", "i-0aaaaaaaaaaaaaaaa", _compiled(tmp_path / "a", PREFILL)))
    _save(shipped, cloud["node"]("decode-0", "i-0bbbbbbbbbbbbbbbb", _compiled(tmp_path / "b", DECODE)))
    s3 = cloud["s3"]
    manifest = cache.promote(CFG, s3, CACHE, ["prefill-0", "decode-0"])
    assert set(manifest["files"]) == set(PREFILL) | set(DECODE)
    assert manifest["toolchain"] == KEY
    assert manifest["promoted_from"]["decode-0"]["upload"] == f"s3://{BUCKET}/neuron/2.33/nodes/decode-0/{KEY}/"
    fleet = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="neuron/2.33/fleet/")["Contents"])
    assert fleet == sorted([f"neuron/2.33/fleet/{KEY}/manifest.json", *(f"neuron/2.33/fleet/{KEY}/files/{rel}" for rel in {**PREFILL, **DECODE})])

    # Someone with write access to fleet/ changes a graph and adds one (what a poisoned cache looks like).
    tampered = "neuron-compile-cache/neuronxcc-2.33/MODULE_decode/model.neff"
    s3.put_object(Bucket=BUCKET, Key=f"neuron/2.33/fleet/{KEY}/files/{tampered}", Body=b"x" * len(DECODE[tampered]))
    s3.put_object(Bucket=BUCKET, Key=f"neuron/2.33/fleet/{KEY}/files/neuron-compile-cache/evil.neff", Body=b"evil")

    res = _stage_new_node(cloud, tmp_path / "new", shipped, "decode-1", "i-0cccccccccccccccc")
    assert _restored(tmp_path / "new" / "cache") == {rel: data for rel, data in {**PREFILL, **DECODE}.items() if rel != tampered}
    assert f"dropped {tampered}: its sha256 or size differs from the manifest" in res.stdout
    assert "dropped neuron-compile-cache/evil.neff: not in the manifest" in res.stdout
    assert "restored 3 of 4 files verified against the manifest (1 missing or dropped: compiled again when needed)" in res.stdout


def test_promotion_refuses_an_upload_that_is_not_whole(cloud: dict[str, Any], tmp_path: Path, shipped: Shipped) -> None:
    _save(shipped, cloud["node"]("prefill-0", "i-0aaaaaaaaaaaaaaaa", _compiled(tmp_path / "a", PREFILL)))
    s3 = cloud["s3"]
    area = f"neuron/2.33/nodes/prefill-0/{KEY}/"
    rel = "vllm/prefill.json"
    s3.put_object(Bucket=BUCKET, Key=f"{area}files/{rel}", Body=b"{} ")  # a size the manifest does not say
    with pytest.raises(cache.CacheError, match=re.escape(f"prefill-0: {rel} has 3 bytes in S3, its manifest says 2")):
        cache.promote(CFG, s3, CACHE, ["prefill-0"])
    s3.delete_object(Bucket=BUCKET, Key=f"{area}manifest.json")
    with pytest.raises(cache.CacheError, match=r"prefill-0: .* holds no upload with a manifest\.json"):
        cache.promote(CFG, s3, CACHE, ["prefill-0"])
    with pytest.raises(cache.CacheError, match=r"decode-1: .* holds no upload with a manifest\.json \(none yet"):
        cache.promote(CFG, s3, CACHE, ["decode-1"])
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix="neuron/2.33/fleet/"), "nothing promoted"


def test_promotion_refuses_an_upload_whose_content_is_not_what_its_manifest_says(cloud: dict[str, Any], tmp_path: Path, shipped: Shipped) -> None:
    """A node (compromised, or confused) changes a graph after its manifest was made, keeping the size:
    promotion reads the content, refuses it, and promotes nothing."""
    _save(shipped, cloud["node"]("prefill-0", "i-0aaaaaaaaaaaaaaaa", _compiled(tmp_path / "a", PREFILL)))
    s3 = cloud["s3"]
    rel = "neuron-compile-cache/neuronxcc-2.33/MODULE_prefill/model.neff"
    s3.put_object(Bucket=BUCKET, Key=f"neuron/2.33/nodes/prefill-0/{KEY}/files/{rel}", Body=b"X" * len(PREFILL[rel]))
    with pytest.raises(cache.CacheError, match=re.escape(f"prefill-0: {rel} in S3 has sha256 ")) as refused:
        cache.promote(CFG, s3, CACHE, ["prefill-0"])
    assert "the upload was changed after its manifest was made; nothing was promoted" in str(refused.value)
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix="neuron/2.33/fleet/"), "nothing promoted"


def test_a_replacement_never_takes_its_own_copy_over_the_fleets(cloud: dict[str, Any], tmp_path: Path, shipped: Shipped) -> None:
    """The fleet's graph and the node's own saved copy at the same path: the fleet's is what loads."""
    _save(shipped, cloud["node"]("prefill-0", "i-0aaaaaaaaaaaaaaaa", _compiled(tmp_path / "a", PREFILL)))
    cache.promote(CFG, cloud["s3"], CACHE, ["prefill-0"])
    # Later the same identity saves a different graph at the same path (its own area, its own manifest).
    rel = "neuron-compile-cache/neuronxcc-2.33/MODULE_prefill/model.neff"
    own = PREFILL | {rel: b"this node's own, not promoted" * 10, "vllm/own-only.json": b"[]"}
    _save(shipped, cloud["node"]("prefill-0", "i-0dddddddddddddddd", _compiled(tmp_path / "b", own)))
    res = _stage_new_node(cloud, tmp_path / "new", shipped, "prefill-0", "i-0eeeeeeeeeeeeeeee")
    restored = _restored(tmp_path / "new" / "cache")
    assert restored[rel] == PREFILL[rel], "the fleet's graph, not the node's own copy"
    assert restored["vllm/own-only.json"] == b"[]", "what only the node saved is still restored"
    lines = res.stdout.splitlines()
    own_at = next(i for i, x in enumerate(lines) if "compile cache restored from" in x and "nodes/prefill-0" in x)
    fleet_at = next(i for i, x in enumerate(lines) if "compile cache restored from" in x and "/fleet" in x)
    assert own_at < fleet_at, "the node's own first, then the fleet's over it"


def test_a_new_images_toolchain_never_loads_the_old_graphs_and_both_caches_stay(cloud: dict[str, Any], tmp_path: Path, shipped: Shipped) -> None:
    """The fleet's cache was compiled by SDK 2.21; a node of the next image (another neuronx-cc) restores
    none of it, compiles, saves and is promoted under its own key, and SDK 2.21 nodes still get theirs."""
    s3 = cloud["s3"]
    _save(shipped, cloud["node"]("prefill-0", "i-0aaaaaaaaaaaaaaaa", _compiled(tmp_path / "a", PREFILL)))
    cache.promote(CFG, s3, CACHE, ["prefill-0"])
    res = _stage_new_node(cloud, tmp_path / "next", shipped, "prefill-0", "i-0bbbbbbbbbbbbbbbb", image="sdk-2.22")
    assert f"compile cache key {KEY_NEXT} (trn3.48xlarge: neuronx-cc 2.22.12.0, torch-neuronx 2.8.0.2.10, vllm 0.10.2, vllm-neuron 0.2.0)" in res.stdout
    assert f"no compile cache in {CACHE}/fleet/{KEY_NEXT} (the fleet's, promoted by an operator) yet" in res.stdout
    assert f"no compile cache in {CACHE}/nodes/prefill-0/{KEY_NEXT} (this node's own, saved before) yet" in res.stdout
    assert _restored(tmp_path / "next" / "cache") == {}, "no graph of SDK 2.21 loads under SDK 2.22"

    recompiled = {rel: data + b" by 2.22" for rel, data in PREFILL.items()}
    _save(shipped, cloud["node"]("prefill-0", "i-0bbbbbbbbbbbbbbbb", _compiled(tmp_path / "next" / "cache", recompiled), image="sdk-2.22"))
    assert cache.promote(CFG, s3, CACHE, ["prefill-0"])["toolchain"] == KEY_NEXT, "the node's latest upload is the one promoted"
    both = {o["Key"].split("/")[3] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="neuron/2.33/fleet/")["Contents"]}
    assert both == {KEY, KEY_NEXT}, "promoting the new image's cache leaves the old image's in place (a rollback still finds it)"

    old = _stage_new_node(cloud, tmp_path / "old", shipped, "decode-1", "i-0cccccccccccccccc", image="sdk-2.21")
    assert _restored(tmp_path / "old" / "cache") == PREFILL, old.stdout
    new = _stage_new_node(cloud, tmp_path / "new", shipped, "decode-1", "i-0dddddddddddddddd", image="sdk-2.22")
    assert _restored(tmp_path / "new" / "cache") == recompiled, new.stdout


def test_promotion_refuses_uploads_of_two_toolchains_at_once(cloud: dict[str, Any], tmp_path: Path, shipped: Shipped) -> None:
    s3 = cloud["s3"]
    _save(shipped, cloud["node"]("prefill-0", "i-0aaaaaaaaaaaaaaaa", _compiled(tmp_path / "a", PREFILL)))
    _save(shipped, cloud["node"]("decode-0", "i-0bbbbbbbbbbbbbbbb", _compiled(tmp_path / "b", DECODE), image="sdk-2.22"))
    with pytest.raises(cache.CacheError, match=re.escape(f"the chosen nodes run different toolchains (decode-0: {KEY_NEXT}, prefill-0: {KEY})")):
        cache.promote(CFG, s3, CACHE, ["prefill-0", "decode-0"])
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix="neuron/2.33/fleet/"), "nothing promoted"


@pytest.mark.parametrize(
    ("dists", "instance_type", "same"),
    [
        (IMAGES["sdk-2.21"][::-1], "trn3.48xlarge", True),  # the order the directory lists them in does not matter
        ([*IMAGES["sdk-2.21"], "numpy-2.1.0", "huggingface_hub-0.36.2"], "trn3.48xlarge", True),  # nor a library that does not compile
        (["neuronx_cc-2.21.33.0", "torch_neuronx-2.8.0.2.10", "vllm_neuron-0.2.1", "vllm-0.10.2"], "trn3.48xlarge", False),  # vllm-neuron traces
        ([*IMAGES["sdk-2.21"], "libneuronxla-2.2.1"], "trn3.48xlarge", False),  # a tracing library added
        (IMAGES["sdk-2.21"], "trn2.48xlarge", False),  # another target
    ],
)
def test_the_toolchain_key_changes_with_what_compiles_and_only_with_it(tmp_path: Path, shipped: Shipped, dists: list[str], instance_type: str, same: bool) -> None:
    venv = _venv(tmp_path, dists)
    out = subprocess.run([sys.executable, str(shipped("gptoss-cache-manifest")), "toolchain", f"{venv.parent}/venv*", instance_type],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert (out.split()[0] == KEY) is same, out
    assert out.startswith(f"{instance_type}-")


def test_a_node_without_the_vllm_venv_restores_no_cache_and_says_why(tmp_path: Path, shipped: Shipped) -> None:
    res = subprocess.run([sys.executable, str(shipped("gptoss-cache-manifest")), "toolchain", f"{tmp_path}/none*", "trn3.48xlarge"], capture_output=True, text=True)
    assert res.returncode == 1
    assert res.stderr.strip() == f"gptoss-cache-manifest: no vLLM venv matches {tmp_path}/none*: the toolchain is unknown"
