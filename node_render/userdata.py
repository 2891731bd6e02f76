"""Packaging a node's files: the scripts as shipped, the bundle, the user data, the scripts asset."""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import lzma
import re
import tarfile
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import yaml

from node_render.node_scripts import NODE_SCRIPTS, shipped_scripts
from node_render.paths import BIN, BUNDLE, CLUSTER_ENV, DEPLOY_ENV, ETC, SIGNAL_ENV, UNIT_DIR
from node_render.quoting import parse_env_file

if TYPE_CHECKING:
    from clusterspec.config import ClusterConfig
    from node_render.node_files import NodeRender

USER_DATA_LIMIT = 16 * 1024


SOFTWARE_ASSET = "gptoss-software.tar.xz"

# The unit that fetches and installs the node's software: with the boot's own scripts, all a node's
# user data carries. Everything else a node runs is its software (the stack's software asset).
BOOT_UNITS = frozenset({"gptoss-scripts.service"})
# Where a node's own files sit in the software asset: nodes/<node>/<path>.
NODES_PREFIX = "nodes"


def boot_files(render: NodeRender) -> dict[str, tuple[str, int]]:
    """What a node's user data carries: the boot, the software fetch and its unit, the status report and
    the gate's failure answer (these work when the fetch does not). A change here is a change of the
    machine: it replaces the instance."""
    paths = {f"{UNIT_DIR}/{u}" for u in BOOT_UNITS} | {f"{BIN}/{n}" for n in NODE_SCRIPTS}
    return {p: v for p, v in render.files.items() if p in paths or (p.startswith("/") and PurePosixPath(p).name in NODE_SCRIPTS)}


def node_software(render: NodeRender) -> dict[str, tuple[str, int]]:
    """A node's own files in the software asset: everything it renders but its boot files."""
    boot = boot_files(render)
    return {p: v for p, v in render.files.items() if p not in boot}


def software_asset(renders: list[NodeRender], *, bin_dir: str = BIN) -> bytes:
    """The fleet's software, one reproducible tarball for the whole stack (its sha256 is the version):
    the scripts every node shares at their paths, each node's own files under nodes/<node>/."""
    scripts = shipped_scripts()
    names = set().union(*(r.scripts for r in renders)) - NODE_SCRIPTS
    files = {f"{bin_dir}/{n}": (scripts[n], 0o755) for n in sorted(names)}
    for r in renders:
        for path, content in r.shared.items():
            assert files.setdefault(path, content) == content, f"{path} differs between nodes: it cannot be shared"
        for path, content in node_software(r).items():
            files[f"/{NODES_PREFIX}/{r.node.name}{path}"] = content
    return bundle(files)


def node_files_in(asset: bytes, node: str) -> dict[str, tuple[str, int]]:
    """A node's own files as the software asset holds them (tests, the deploy's diff)."""
    prefix = f"/{NODES_PREFIX}/{node}/"
    return {"/" + p.removeprefix(prefix): v for p, v in unbundle(asset).items() if p.startswith(prefix)}


XZ_PRESET = 9 | lzma.PRESET_EXTREME


def tarball(files: Mapping[str, tuple[str, int]]) -> bytes:
    """A reproducible tarball of a node's files (sorted, zero mtimes, root-owned), uncompressed."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path in sorted(files):
            text, mode = files[path]
            data = text.encode()
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def bundle(files: Mapping[str, tuple[str, int]]) -> bytes:
    """The xz of a node's tarball: its user data's payload.

    xz rather than gzip: 5 to 12 % smaller (`make bench-scale` prints both), and the nodes'
    user data is most of the template, which CloudFormation caps at 1 MB.
    """
    return _xz(tarball(files))


@functools.lru_cache(maxsize=1024)
def _xz(raw: bytes) -> bytes:
    """xz of a tarball, once per content: synth needs each node's bundle twice (user data and
    gate digest); the cache holds more nodes than any fleet (a few MB of tarballs)."""
    # A 1 MiB dictionary holds the whole tarball; preset 9's 64 MiB would only cost time.
    # XZ_PRESET, by measurement (`make bench-scale` prints the table): 9|EXTREME makes a node's
    # user data about 90 bytes (1 %) smaller than 6 or 9, for about 10 ms more per node. Kept:
    # another preset changes every node's user data bytes, so every deployed node would be
    # stopped and started at its next deploy for a saving of about a second of synth.
    filters = [{"id": lzma.FILTER_LZMA2, "preset": XZ_PRESET, "dict_size": 1 << 20}]
    return lzma.compress(raw, format=lzma.FORMAT_XZ, filters=filters)


# The estimate's compression: the same tarball, the same 1 MiB dictionary, preset 6. Measured on
# one node per shape of every example, recipe and the 56-decode fleet (62 tarballs): 56 to 96 bytes
# (0.7 to 1.3 %) larger than XZ_PRESET's output, never smaller, in a third of the time (13 ms vs
# 39 ms a node). tests/node_render/test_limits.py holds the "never smaller" for every shape it sizes.
ESTIMATE_PRESET = 6
Compress = Callable[[Mapping[str, tuple[str, int]]], bytes]


def bundle_bound(files: Mapping[str, tuple[str, int]]) -> bytes:
    """What `bundle` makes, compressed faster and a little larger: the stack-size estimate's input
    (an estimate may be high, never low). Never shipped."""
    filters = [{"id": lzma.FILTER_LZMA2, "preset": ESTIMATE_PRESET, "dict_size": 1 << 20}]
    return lzma.compress(tarball(files), format=lzma.FORMAT_XZ, filters=filters)


def launch_inputs(cfg: ClusterConfig, role: str) -> str:
    """What the instance of a node of `role` is launched from, as known at synth: the settings of
    its launch template and image that replace the instance when they change (type and NICs,
    image, root volume, monitoring, capacity target and placement, subnet). Nothing else: a
    setting that leaves the instance alone must leave its gate alone too.

    An image resolved from an SSM parameter at deploy time is not known here: pin it
    (`gptoss pin-ami`) so that a new image is a change the gate sees.
    """
    hw = cfg.hardware
    capacity = cfg.capacity
    doc = {
        "instance": [cfg.instance_type, hw.network_cards, hw.efa_interfaces],
        "image": cfg.ami_id or f"ssm:{cfg.ami_ssm_parameter}",
        "root_volume_gb": cfg.root_volume_gb,
        "monitoring": cfg.detailed_monitoring,
        "capacity": [capacity.type, *capacity.target(role), capacity.preference, capacity.placement_group],
        "subnet": [cfg.availability_zone, cfg.network.subnet_id or cfg.network.subnet_cidr],
    }
    return json.dumps(doc, sort_keys=True)


def node_digest(render: NodeRender, software: str, launch: str = "") -> str:
    """8 hex digits that change exactly when the node's instance is replaced: its boot files, its launch
    inputs and, with rollout.software=replace, its own software (node_version; in place, `software` is
    ""): the deploy gate's id, so an update waits for exactly the nodes it replaces."""
    data = bundle(boot_files(render)) + software.encode() + launch.encode()
    return hashlib.sha256(data).hexdigest()[:8]


def unbundle(blob: bytes) -> dict[str, tuple[str, int]]:
    """Read a bundle back (tests, the snapshot)."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(blob))) as tar:
        for m in tar.getmembers():
            f = tar.extractfile(m)
            assert f is not None
            out["/" + m.name] = (f.read().decode(), m.mode)
    return out


_EXTRACT = f'mkdir -p {PurePosixPath(BUNDLE).parent} {ETC} && echo "$0" | base64 -d > {BUNDLE} && tar -xJf {BUNDLE} -C /'


_DEPLOY = f"printf '%s\\n' \"$@\" > {DEPLOY_ENV}"


# The instance metadata (its user data holds the deploy gate's URL; its credentials are the node's
# role) for root only: every unit runs as root, and any other local user is refused (AWS's own
# recipe for limiting IMDS access: an iptables owner match). Applied at every boot, once.
IMDS_ROOT_ONLY = (
    "if command -v iptables >/dev/null 2>&1; then "
    "iptables -C OUTPUT -d 169.254.169.254/32 -p tcp --syn -m owner ! --uid-owner 0 -j REJECT --reject-with tcp-reset 2>/dev/null || "
    "iptables -I OUTPUT 1 -d 169.254.169.254/32 -p tcp --syn -m owner ! --uid-owner 0 -j REJECT --reject-with tcp-reset; "
    "else echo 'gptoss: no iptables: the instance metadata stays open to every local user' >&2; fi"
)


def _signal_line(url: str | None, gate_id: str | None = None) -> str:
    """The bootcmd line that writes the deploy gate's URL (and its wait condition's logical id, which
    the node asks CloudFormation about) to a root-only file, or removes it.

    A plain string line, not an argument list: cloud-init runs bootcmd as one shell script
    (`/bin/sh FILE`, the file root-only and removed after), so `printf` - a builtin - writes
    the URL without it ever being in a process's argv (`ps`), an environment or the journal.
    """
    if url is None:
        return f"rm -f {SIGNAL_ENV}"
    gate = f" 'GPTOSS_GATE={gate_id}'" if gate_id else ""
    return f"(umask 077 && printf '%s\\n' 'GPTOSS_SIGNAL_URL={url}'{gate} > {SIGNAL_ENV} && chmod 600 {SIGNAL_ENV})"


# libyaml's emitter when PyYAML has it: the same text (a test compares), without walking each
# node's base64 bundle character by character in Python.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def node_version(render: NodeRender) -> str:
    """The sha256 of what this node runs of the software (its own files, the scripts and shared files its
    manifest lists): with rollout.software=replace, its user data carries it, so that a change of exactly
    this node's software gives it a new launch template."""
    scripts = shipped_scripts()
    files = dict(node_software(render)) | dict(render.shared)
    files |= {f"{BIN}/{n}": (scripts[n], 0o755) for n in sorted(render.scripts - NODE_SCRIPTS)}
    return hashlib.sha256(tarball(files)).hexdigest()


def user_data(
    render: NodeRender,
    *,
    software_parameter: str,
    software_digest: str | None = None,
    signal_url: str | None = None,
    gate_id: str | None = None,
    compile_cache_uri: str | None = None,
    compress: Compress = bundle,
) -> str:
    """cloud-init user data: the node's boot files and what the stack knows only at deploy time.

    The node's software (every other file it runs) is fetched at boot: the version the SSM parameter
    `software_parameter` names, the fleet's current one whatever the launch template's age. With
    rollout.software=in-place a new version leaves this text alone (State Manager applies it to the
    running nodes); with replace, `software_digest` (node_version) is here too, so a node whose own
    software changed gets a new launch template and a new instance.

    `compile_cache_uri` (the stack's bucket, or the configured location) and
    `signal_url` (the deploy gate's wait condition handle) are CDK tokens at synth; CloudFormation
    fills them in. No other node's address is here: an instance of any node can be replaced at any
    time, and the nodes that need their peers read them from EC2 (gptoss-members). The signal URL
    goes to its own root-only file (whoever holds it can fail the deploy), never to deploy.env, which
    the proxy and the other units read. `compress` is for the size estimate alone (bundle_bound).

    Everything is applied in `bootcmd`, which cloud-init runs at every boot with the current
    user data, where write_files and runcmd would run only once per instance. gptoss-bootstrap
    then starts the software's fetch at every boot (there is no first-boot special case). Data goes
    to `sh -c` as arguments, never inside the script text.
    """
    region = parse_env_file(render.files[CLUSTER_ENV][0])["AWS_REGION"]
    values = [f"AWS_REGION={region}", f"GPTOSS_NODE={render.node.name}", f"GPTOSS_SOFTWARE_PARAMETER={software_parameter}"]
    if software_digest is not None:
        values.append(f"GPTOSS_SOFTWARE_DIGEST={software_digest}")
    if "gptoss-save-cache" in render.scripts:
        if compile_cache_uri is None:
            raise ValueError(f"{render.node.name}: saves its compile cache but no compile cache location was given")
        values.append(f"GPTOSS_COMPILE_CACHE_URI={compile_cache_uri}")
    doc = {
        "bootcmd": [
            ["sh", "-c", _EXTRACT, base64.b64encode(compress(boot_files(render))).decode()],
            ["sh", "-c", _DEPLOY, "sh", *values],
            _signal_line(signal_url, gate_id),
            IMDS_ROOT_ONLY,
            [f"{BIN}/gptoss-bootstrap"],
        ],
    }
    return "#cloud-config\n" + yaml.dump(doc, Dumper=_DUMPER, sort_keys=False, width=1 << 20)


def parse_user_data(text: str) -> tuple[dict[str, tuple[str, int]], dict[str, str], dict[str, Any]]:
    """Parse user data back into (boot files, deploy.env plus the signal URL, the cloud-config document)."""
    # libyaml's safe loader where PyYAML has it (the same documents, several times faster: a replay reads hundreds).
    doc = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    extract, hosts, signal, *_ = doc["bootcmd"]
    assert extract[:3] == ["sh", "-c", _EXTRACT] and hosts[:4] == ["sh", "-c", _DEPLOY, "sh"], doc["bootcmd"]
    files = unbundle(base64.b64decode(extract[3]))
    deploy = parse_env_file("\n".join(hosts[4:]))
    url = re.match(r"^\(umask 077 && printf '%s\\n' 'GPTOSS_SIGNAL_URL=([^']*)'(?: 'GPTOSS_GATE=([^']*)')? > ", signal)
    assert url or signal == _signal_line(None), signal
    gate = {"GPTOSS_SIGNAL_URL": url.group(1)} | ({"GPTOSS_GATE": url.group(2)} if url.group(2) else {}) if url else {}
    return files, deploy | gate, doc

