"""Build (once) and cache the Debian guest image the VM tests boot.

The image is a Debian trixie root (systemd, cloud-init, mdadm, xfsprogs, ...) made by
mmdebstrap, plus the fakes in tests/vm/guest. It is cached outside the repository, keyed by
everything that goes into it (package list, guest files, this builder), so a second run
reuses it and any change rebuilds it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
GUEST = HERE / "guest"
HUB_PY = HERE.parent / "fakes" / "hub.py"
# vLLM's --middleware as the fake servers honour it (the loopback fakes use the same file).
MIDDLEWARE_PY = HERE.parent / "fakes" / "vllm_middleware.py"
SUITE = "trixie"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = (
    "linux-image-amd64,initramfs-tools,systemd-sysv,udev,dbus,cloud-init,mdadm,xfsprogs,curl,git,"
    "python3,python3-venv,xz-utils,iproute2,ca-certificates,openssh-server,netbase,kmod,iptables,haproxy"
)
# The real client library in the guest's vLLM venv (the DLAMI's Python has its own).
GUEST_HF_HUB = "huggingface_hub==1.33.0"
# The AWS CLI the node scripts call (the cluster's AWS is the host's moto: tests/vm/aws.py).
GUEST_AWS = ("awscli==1.46.3",)
GUEST_PYTHON = "3.13"
ROOT_SIZE = "6G"
HOST_TOOLS = {
    "qemu-system-x86_64": "qemu-system-x86",
    "qemu-img": "qemu-utils",
    "mmdebstrap": "mmdebstrap",
    "cloud-localds": "cloud-image-utils",
    "ssh": "openssh-client",
    "mkfs.ext4": "e2fsprogs",
    "socat": "socat",  # relays each guest's AWS connections to the host's moto
}


@dataclass(frozen=True)
class Image:
    """A built guest: root disk, kernel, initrd and the harness's SSH key."""

    root: Path
    kernel: Path
    initrd: Path
    key: Path


def cache_root() -> Path:
    """Where images live: GPTOSS_VM_CACHE, else ~/.cache/gptoss-vm (never the repository)."""
    base = os.environ.get("GPTOSS_VM_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "gptoss-vm")
    return Path(base)


def missing_tools() -> list[str]:
    """Debian packages the harness needs that this machine lacks."""
    return sorted({pkg for tool, pkg in HOST_TOOLS.items() if shutil.which(tool) is None})


def image_key() -> str:
    """A digest of every input of the image."""
    h = hashlib.sha256()
    for part in (SUITE, MIRROR, PACKAGES, GUEST_HF_HUB, *GUEST_AWS, GUEST_PYTHON, ROOT_SIZE):
        h.update(part.encode() + b"\0")
    for path in sorted([*GUEST.rglob("*"), HUB_PY, MIDDLEWARE_PY, Path(__file__)]):
        if path.is_file():
            h.update(str(path.relative_to(HERE.parent)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _run(cmd: list[str], log: Path, **kw: object) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, **kw)  # type: ignore[call-overload]


def build(progress: object = print) -> Image:
    """Return the cached image, building it first when the cache has none for this key."""
    key = image_key()
    final = cache_root() / key
    image = Image(final / "root.qcow2", final / "vmlinuz", final / "initrd.img", final / "harness_key")
    if (final / "DONE").exists():
        return image
    if os.geteuid() != 0:
        raise RuntimeError("building the guest image needs root (mmdebstrap --mode=root, mkfs.ext4 -d with ownership)")
    # One build at a time: a second run waits for the first (whose image it then uses) instead of
    # deleting the directory the first is still writing.
    cache_root().mkdir(parents=True, exist_ok=True)
    with (cache_root() / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "DONE").exists():
            return image
        return _build(key, final, image, progress)


def _build(key: str, final: Path, image: Image, progress: object) -> Image:
    work = cache_root() / f"{key}.building"
    if work.exists():  # a build that was killed: start over (an error here says what holds it)
        shutil.rmtree(work)
    work.mkdir(parents=True)
    log = work / "build.log"
    say = progress if callable(progress) else print
    say(f"building the guest image {key} (log: {log})")
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gptoss-vm-harness", "-f", str(work / "harness_key")], log)
    wheels = work / "wheels"
    _run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--implementation", "cp",
         "--python-version", GUEST_PYTHON, "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
         "--platform", "manylinux2014_x86_64", "-d", str(wheels), GUEST_HF_HUB, *GUEST_AWS],
        log,
    )  # fmt: skip
    rootdir = work / "root"
    env = {**os.environ, "GUEST_SRC": str(GUEST), "HUB_PY": str(HUB_PY), "MIDDLEWARE_PY": str(MIDDLEWARE_PY), "WHEELS": str(wheels), "PUBKEY": str(work / "harness_key.pub")}
    _run(
        ["mmdebstrap", "--mode=root", "--variant=minbase", f"--include={PACKAGES}",
         f"--customize-hook=bash {GUEST / 'customize.sh'} \"$1\"", SUITE, str(rootdir), MIRROR],
        log,
        env=env,
    )  # fmt: skip
    boot = rootdir / "boot"
    shutil.copy(next(boot.glob("vmlinuz-*")), work / "vmlinuz")
    shutil.copy(next(boot.glob("initrd.img-*")), work / "initrd.img")
    raw = work / "root.raw"
    _run(["mkfs.ext4", "-q", "-L", "gptoss-root", "-d", str(rootdir), str(raw), ROOT_SIZE], log)
    _run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(work / "root.qcow2")], log)
    raw.unlink()
    shutil.rmtree(rootdir)
    shutil.rmtree(wheels)
    (work / "DONE").write_text(key + "\n")
    shutil.rmtree(final, ignore_errors=True)
    work.rename(final)
    # Older images (other keys) only take disk space.
    for old in cache_root().iterdir():
        if old.name != key and old.is_dir() and not old.name.endswith(".building"):
            shutil.rmtree(old, ignore_errors=True)
    return image


if __name__ == "__main__":
    img = build()
    print(img.root)
