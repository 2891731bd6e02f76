"""Rules that values must follow before they reach CloudFormation, systemd, bash, git or a node.

Each check raises a rule error naming the field, the value, the rule and the fix. The rules are
the ones the consumers enforce later (AWS's naming and CIDR rules, systemd's specifiers and
quoting, git's ref format, what a node's boot scripts assume), applied at plan and synth time,
when a mistake costs nothing.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
from importlib.util import find_spec
from pathlib import Path, PurePosixPath

from clusterspec.errors import rule_error

# Directories a path setting may not be (or hold): the OS's own, and the ones the DLAMI and
# this project keep their files in. A mount at one of them, or above one, hides what is there.
SYSTEM_DIRS = frozenset(
    ["/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/usr/bin", "/usr/lib", "/usr/local", "/usr/sbin", "/var", "/var/lib", "/var/log", "/var/tmp", "/opt/dlami"]
)
PROJECT_DIRS = ("/opt/gptoss", "/etc/gptoss", "/var/lib/gptoss", "/run/gptoss", "/etc/systemd")
PATH_CHARS = re.compile(r"^[A-Za-z0-9_./-]+$")
GLOB_CHARS = re.compile(r"^[A-Za-z0-9_./*?\[\]-]+$")
MAX_PATH = 200
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Characters that cannot be carried: a newline ends a unit or env-file line, NUL ends a C string,
# a single quote ends the quoting both systemd and bash read, a backslash starts systemd's escapes.
UNCARRIABLE = {"\n": "a newline", "\r": "a carriage return", "\0": "a NUL byte", "'": "a single quote"}


def node_path(field: str, value: str, *, glob: bool = False, not_above: tuple[str, ...] = ()) -> str:
    """An absolute, normalized directory path the node's scripts and units can carry as is."""
    chars = GLOB_CHARS if glob else PATH_CHARS
    allowed = "letters, digits, _ . - /" + (" and the glob characters * ? [ ]" if glob else "")
    if not value.startswith("/"):
        raise rule_error(field, value, "must be an absolute path", f"start it with /, e.g. /{value.lstrip('./')}")
    if not chars.match(value):
        raise rule_error(
            field, value, f"holds characters a unit file or env file would change ({allowed} only; no %, $, spaces)", "rename the directory"
        )
    normal = str(PurePosixPath(value))
    parts = value.split("/")[1:]
    if value != "/" and (normal != value or "." in parts or ".." in parts or value.endswith("/")):
        raise rule_error(field, value, "must be a normalized path (no '..', '.', '//' or trailing '/')", f"write it as {normal}")
    if len(value) > MAX_PATH:
        raise rule_error(field, value, f"is longer than {MAX_PATH} characters", "choose a shorter path")
    fixed = PurePosixPath(value.split("*")[0].split("?")[0].split("[")[0]) if glob else PurePosixPath(value)
    if str(fixed) in SYSTEM_DIRS or value in SYSTEM_DIRS:
        raise rule_error(field, value, "is a system directory", "use a directory of its own below it, e.g. " + str(PurePosixPath(value) / "gptoss"))
    for own in (*PROJECT_DIRS, *not_above):
        own_path = PurePosixPath(own)
        if fixed == own_path or fixed in own_path.parents or own_path in fixed.parents:
            raise rule_error(
                field, value, f"overlaps {own}, where the node keeps files it needs", "choose a directory outside it and not above it"
            )
    return value


def file_name(field: str, value: str) -> str:
    """A plain file name (no directory part)."""
    if "/" in value or value in {"", ".", ".."} or not re.fullmatch(r"^[A-Za-z0-9_.-]+$", value) or len(value) > 100:
        raise rule_error(field, value, "must be a file name (letters, digits, _ . -; no '/')", "give only the name, e.g. bench_clean.json")
    return value


def carried(field: str, value: str, *, extra: dict[str, str] | None = None, max_len: int = 4096) -> str:
    """A string that reaches a unit or env file: refuse what cannot be quoted for both systemd and bash."""
    for ch, name in (UNCARRIABLE | (extra or {})).items():
        if ch in value:
            raise rule_error(field, value, f"holds {name}, which cannot be carried into the node's unit and env files", "remove it")
    if len(value) > max_len:
        raise rule_error(field, value, f"is longer than {max_len} characters", "shorten it")
    return value


def env_name(field: str, value: str) -> str:
    """An environment variable name bash and systemd both accept; GPTOSS_* belongs to the project."""
    if not ENV_NAME.fullmatch(value):
        raise rule_error(field, value, "is not a valid environment variable name", "use letters, digits and _ , not starting with a digit")
    if value.startswith("GPTOSS_"):
        raise rule_error(field, value, "GPTOSS_* variables are the project's own", "choose another name")
    return value


def positive_int_text(field: str, value: str, *, maximum: int) -> str:
    """An environment value that must be a whole number of seconds."""
    if not re.fullmatch(r"^[0-9]+$", value) or not 0 < int(value) <= maximum:
        raise rule_error(
            field, value, f"must be a whole number of seconds from 1 to {maximum}",
            "set it to a positive whole number (a negative or empty value would make systemd drop the unit's timeouts)",
        )  # fmt: skip
    return value


GIT_REF_MAX_BYTES = 255


def git_ref(field: str, value: str) -> str:
    """A tag or a full commit id: never a branch, which moves under a running fleet."""
    if re.fullmatch(r"^[0-9a-f]{40}$", value):
        return value
    if re.fullmatch(r"^[0-9A-Fa-f]{7,40}$", value) and re.search(r"[0-9]", value) and re.search(r"[A-Fa-f]", value):
        raise rule_error(
            field, value, "looks like a commit id but is not a full lowercase one; the node would fetch it as a tag and fail",
            "give the full 40-character commit id in lowercase (git rev-parse REF), or a tag",
        )  # fmt: skip
    name = value.removeprefix("refs/tags/")
    # A tag is one file under .git/refs/tags/ on the node: one path component, 255 bytes at most on its file system.
    if len(name.encode()) > GIT_REF_MAX_BYTES:
        raise rule_error(field, value, f"is longer than a git tag can be ({GIT_REF_MAX_BYTES} bytes: a tag is one file name on the node)",
                         "give the tag's real name, or a 40-character commit id")  # fmt: skip
    if value.startswith("refs/") and not value.startswith("refs/tags/"):
        raise rule_error(field, value, "names a branch or another moving ref", "pin a tag (release-...) or a 40-character commit id")
    if name.startswith("-") or not re.fullmatch(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", name) or ".." in name or name.endswith((".", ".lock")):
        raise rule_error(field, value, "is not a valid git tag name", "give a tag such as release-0.29.0.1.2.0, or a 40-character commit id")
    if not re.search(r"[0-9]", name) or name.lower() in {"head", "main", "master", "develop", "trunk", "latest", "stable"}:
        raise rule_error(
            field, value, "looks like a branch (a moving target: nodes booted at different times would run different code); "
            "the node fetches it as a tag",
            "pin a release tag (one with a version number) or a 40-character commit id",
        )  # fmt: skip
    return value


def https_url(field: str, value: str) -> str:
    """A repository URL the nodes can reach: HTTPS (the only egress the security group opens), no credentials."""
    if not value.startswith("https://"):
        raise rule_error(field, value, "must be an https:// URL (the security group opens only HTTPS to the world)", "give the repository's https:// URL")
    if "@" in value[8:].split("/", 1)[0]:
        raise rule_error(field, value, "holds credentials, which anyone who can read the instance's user data would see", "use a public URL")
    if not re.fullmatch(r"^https://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~/-]*)?$", value):
        raise rule_error(field, value, "is not a plain https:// URL (host, optional port, path of letters, digits and . _ ~ / -)", "give the repository's https:// URL")
    port = re.fullmatch(r"^https://[^/:]+:([0-9]+).*$", value)
    if port and int(port.group(1)) != 443:
        raise rule_error(field, value, f"uses port {int(port.group(1))}; the security group lets the nodes out on HTTPS (443) only",
                         "use the repository's URL on port 443 (no port in the URL)")  # fmt: skip
    return value


def _ip_network(field: str, value: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise rule_error(field, value, "is not a CIDR block", "give a block like 10.42.0.0/16") from None
    if net.version != 4:
        raise rule_error(field, value, "is IPv6; the cluster's subnet, security group and peers are IPv4", "give an IPv4 block")
    if str(net) != value and not re.fullmatch(r"^[0-9.]+/[0-9]{1,2}$", value):
        raise rule_error(field, value, f"is not written as address/prefix length (it means {net})", f"write {net}")
    if str(net) != value:
        raise rule_error(field, value, f"has host bits set (the network is {net})", f"write {net}")
    return net  # type: ignore[return-value]


def cidr(field: str, value: str, *, smallest: int = 28, largest: int = 16) -> ipaddress.IPv4Network:
    """An IPv4 network with no host bits, sized as AWS allows for VPCs and subnets (/16 to /28)."""
    net = _ip_network(field, value)
    if not largest <= net.prefixlen <= smallest:
        raise rule_error(field, value, f"AWS allows /{largest} to /{smallest} here", f"choose a prefix length from /{largest} to /{smallest}")
    if net.is_loopback or net.is_link_local or net.is_multicast or net.is_reserved or net.is_unspecified:
        raise rule_error(field, value, "is a loopback, link-local, multicast or reserved range", "use a private range such as 10.42.0.0/16")
    return net


def operator_cidr(field: str, value: str) -> str:
    """The operator network allowed to reach the proxy: a real network, never the internet."""
    net = _ip_network(field, value)
    if net.prefixlen == 0:
        raise rule_error(field, value, "opening the proxy to the whole internet is refused (no public ingress)", "give your office or VPN CIDR, or use the SSM port forward")
    if net.prefixlen < 8:
        raise rule_error(field, value, "is wider than /8, more than any operator network", "give your office or VPN CIDR (/8 or narrower)")
    return value


@functools.cache
def _partitions() -> list[dict[str, object]]:
    """botocore's own partition data (shipped with boto3), read as a file: synthesis never calls AWS.

    Found without importing botocore (its import, logging and all, is a fortieth of `plan`'s time)."""
    spec = find_spec("botocore")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("botocore (installed with boto3) is needed for its partition data: run make setup")
    data = json.loads((Path(next(iter(spec.submodule_search_locations))) / "data" / "endpoints.json").read_text())
    return list(data["partitions"])


def region_partition(region: str) -> str | None:
    """The partition (aws, aws-cn, ...) of a region botocore knows, else None."""
    for p in _partitions():
        if region in p["regions"]:  # type: ignore[operator]
            return str(p["partition"])
    return None


def region(field: str, value: str) -> str:
    if region_partition(value) is None:
        known = sorted(r for p in _partitions() if p["partition"] == "aws" for r in p["regions"])  # type: ignore[attr-defined]
        raise rule_error(field, value, "is not a region in botocore's partition data", f"use one of {', '.join(known)}")
    return value


def availability_zone(field: str, value: str, region_name: str) -> str:
    if not re.fullmatch(rf"^{re.escape(region_name)}[a-z]$", value):
        if re.fullmatch(r"^[a-z]{2,4}[0-9]-az[0-9]+$", value):
            raise rule_error(
                field, value, "is a zone id; the cluster takes the zone name", f"look it up with aws ec2 describe-availability-zones --zone-ids {value}"
            )  # fmt: skip
        raise rule_error(field, value, f"must be a zone of region {region_name}: the region's name and a letter (EFA nodes share one subnet in one AZ)",
                         f"set availability_zone to e.g. {region_name}a, or change region")  # fmt: skip
    return value


S3_KEY_CHARS = re.compile(r"^[A-Za-z0-9!_.*()/-]*$")


def s3_uri(field: str, value: str) -> str:
    """An s3:// location: a valid bucket name and a prefix of S3's safe characters, without a trailing '/'."""
    m = re.fullmatch(r"^s3://([^/]*)(/.*)?$", value)
    if not m:
        raise rule_error(field, value, "must be an s3:// location", "give s3://bucket/prefix")
    bucket, key = m.group(1), (m.group(2) or "")[1:]
    if (
        not re.fullmatch(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", bucket)
        or ".." in bucket
        or re.fullmatch(r"^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$", bucket)
        or bucket.startswith(("xn--", "sthree-"))
        or bucket.endswith(("-s3alias", "--ol-s3"))
    ):
        raise rule_error(field, value, f"{bucket!r} is not a valid S3 bucket name", "use 3-63 lowercase letters, digits, '.' and '-'")
    if bucket.endswith("--x-s3"):
        raise rule_error(
            field, value, f"{bucket!r} is an S3 directory bucket (S3 Express One Zone): the nodes' S3 permissions and "
            "downloads are for general purpose buckets", "use a general purpose bucket",
        )  # fmt: skip
    if "*" in key:
        raise rule_error(
            field, value, "holds '*', which IAM reads as a wildcard: the nodes' permissions for this location would reach "
            "every prefix it matches", f"name one prefix without '*' (e.g. s3://{bucket}/{key.split('*')[0].strip('/') or 'gptoss'})",
        )  # fmt: skip
    if any(part in (".", "..") for part in key.split("/")):
        raise rule_error(field, value, "has a '.' or '..' segment, which S3 keeps as a name but tools read as a directory step",
                         f"write the prefix without it (s3://{bucket}/{'/'.join(p for p in key.split('/') if p not in ('.', '..', ''))})")  # fmt: skip
    if not S3_KEY_CHARS.fullmatch(key) or "//" in key or key.startswith("/") or value.endswith("/"):
        raise rule_error(
            field, value, "the prefix must use S3's safe characters (letters, digits, ! _ . * ( ) - /), no '//' and no trailing '/'",
            f"write it as s3://{bucket}/{key.strip('/')}" if key.strip("/") else f"write it as s3://{bucket}",
        )  # fmt: skip
    return value


def s3_parts(uri: str) -> tuple[str, str]:
    """(bucket, prefix) of an s3:// location."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def s3_overlap(a: str, b: str) -> bool:
    """Whether one location holds the other (same bucket, one prefix inside the other)."""
    (ba, ka), (bb, kb) = s3_parts(a), s3_parts(b)
    if ba != bb:
        return False
    return ka == kb or not ka or not kb or ka.startswith(kb + "/") or kb.startswith(ka + "/")
