"""The cluster's API keys in its Secrets Manager secret: list, create, rotate, revoke (`gptoss keys`).

The secret's form is the one the router nodes read (userdata/bin/gptoss-keys): {"initial": key or null,
"keys": [{"name", "key", "created", "expires", "requests_per_s", "concurrency"}]}. A key is shown once,
when it is made; `list` shows names, dates and limits, never a key. Every router node takes a change
within serving.endpoint.keys_refresh_s (and one read of the secret).

Each change is a read, then a write of the whole value guarded by the version it read: a second
operator's change in between is not overwritten (the write fails, and says to run it again).
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
from dataclasses import dataclass
from typing import Any

from clusterspec.config import ClusterConfig
from clusterspec.sections.endpoint import ANONYMOUS, KEY_NAME, keys_secret_name
from node_render.haproxy import NODE_KEY_NAME

KEY_PREFIX = "gk-"
KEY_BYTES = 32  # 256 bits: token_urlsafe gives 43 characters
# Names the gate gives keys of its own: each router node's key for what it sends through its own gate (the deploy
# gate's test completion, the benchmark), valid there alone and never in the secret.
RESERVED = {NODE_KEY_NAME: "router node's own key (what it sends through its own gate)",
            ANONYMOUS: "name the gate counts requests without a key under (serving.endpoint.auth=optional)"}


class KeysError(Exception):
    """A key operation that cannot be done: one line for the operator."""


@dataclass(frozen=True)
class KeyRow:
    name: str
    created: str
    expires: str | None
    requests_per_s: int | None
    concurrency: int | None


def secret_id(cfg: ClusterConfig) -> str:
    """The secret the cluster's router nodes read."""
    if cfg.endpoint_auth != "keys":
        raise KeysError(f"{cfg.cluster_name} checks no API key ({cfg.serving.endpoint.auth_reason(cfg.proxy_kind, cfg.cluster_name)})")
    return cfg.serving.endpoint.keys_secret_arn or keys_secret_name(cfg.cluster_name)


def now_text(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(text: str, sid: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys", []), list):
        raise KeysError(f'the secret {sid} is not of the keys\' form (a JSON object with a "keys" list); nothing was changed')
    doc.setdefault("keys", [])
    return doc


class Keys:
    """One cluster's secret of keys, through a boto3 Secrets Manager client."""

    def __init__(self, client: Any, sid: str) -> None:
        self.client = client
        self.sid = sid

    def read(self) -> tuple[dict[str, Any], str]:
        answer = self.client.get_secret_value(SecretId=self.sid)
        return _parse(answer.get("SecretString") or "", self.sid), answer["VersionId"]

    def write(self, doc: dict[str, Any], version: str) -> None:
        # The version read must still be current: another change in between fails this one instead of being lost.
        current = self.client.describe_secret(SecretId=self.sid).get("VersionIdsToStages", {})
        if "AWSCURRENT" not in current.get(version, []):
            raise KeysError(f"the secret {self.sid} changed while this ran (another operator?); nothing was written: run it again")
        self.client.put_secret_value(SecretId=self.sid, SecretString=json.dumps(doc, indent=1))

    def rows(self, now: dt.datetime) -> list[KeyRow]:
        doc, _ = self.read()
        out = [KeyRow("initial", "with the stack", None, None, None)] if doc.get("initial") else []
        for e in doc["keys"]:
            expires = e.get("expires")
            end = _when(expires)
            if end is not None and end <= now:
                continue
            out.append(KeyRow(str(e.get("name")), str(e.get("created")), expires, e.get("requests_per_s"), e.get("concurrency")))
        return out

    def create(self, name: str, now: dt.datetime, *, requests_per_s: int | None = None, concurrency: int | None = None) -> str:
        _check_name(name)
        for field, v in (("--requests-per-s", requests_per_s), ("--concurrency", concurrency)):
            if v is not None and not 1 <= v <= 100000:
                raise KeysError(f"{field} {v}: give 1 to 100000 (or leave it out for the cluster's default)")
        doc, version = self.read()
        if name == "initial" or any(e.get("name") == name and not _expired(e, now) for e in doc["keys"]):
            raise KeysError(f"a key named {name} exists: rotate it (gptoss keys rotate {name}), or give another name")
        key = new_key()
        doc["keys"].append(_entry(name, key, now, requests_per_s, concurrency))
        self.write(doc, version)
        return key

    def rotate(self, name: str, now: dt.datetime, *, grace_s: int) -> tuple[str, str]:
        """A new key for `name`; its current keys stay valid for grace_s. Returns (new key, when the old ones end)."""
        doc, version = self.read()
        ends = now_text(now + dt.timedelta(seconds=grace_s))
        if name == "initial":
            if not doc.get("initial"):
                raise KeysError("no key named initial (it was revoked)")
            old = [{"name": "initial", "key": doc["initial"], "created": "with the stack", "expires": ends}]
            doc["initial"] = None
            doc["keys"].extend(old)
            limits: tuple[int | None, int | None] = (None, None)
        else:
            current = [e for e in doc["keys"] if e.get("name") == name and not _expired(e, now)]
            if not current:
                raise KeysError(f"no key named {name}: gptoss keys list shows the names")
            for e in current:
                if e.get("expires") is None or (_when(e["expires"]) or now) > now + dt.timedelta(seconds=grace_s):
                    e["expires"] = ends
            limits = (current[-1].get("requests_per_s"), current[-1].get("concurrency"))
        key = new_key()
        doc["keys"].append(_entry(name, key, now, *limits))
        self.write(doc, version)
        return key, ends

    def revoke(self, name: str, now: dt.datetime) -> int:
        """Every key of `name`, gone from the secret (each router refuses it within a refresh). Returns how many."""
        doc, version = self.read()
        gone = sum(1 for e in doc["keys"] if e.get("name") == name and not _expired(e, now))
        doc["keys"] = [e for e in doc["keys"] if e.get("name") != name and not _expired(e, now)]
        if name == "initial" and doc.get("initial"):
            doc["initial"] = None
            gone += 1
        if not gone:
            raise KeysError(f"no key named {name}: gptoss keys list shows the names")
        self.write(doc, version)
        return gone


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def _check_name(name: str) -> None:
    if not KEY_NAME.match(name):
        raise KeysError(f"key name {name!r}: 1-64 of A-Z a-z 0-9 . _ - (starting with a letter or digit); e.g. team-search")
    if name in RESERVED:
        raise KeysError(f"key name {name!r} is the {RESERVED[name]}: give another name")


def _entry(name: str, key: str, now: dt.datetime, requests_per_s: int | None, concurrency: int | None) -> dict[str, Any]:
    return {"name": name, "key": key, "created": now_text(now), "expires": None, "requests_per_s": requests_per_s, "concurrency": concurrency}


def _when(text: object) -> dt.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def _expired(entry: dict[str, Any], now: dt.datetime) -> bool:
    end = _when(entry.get("expires"))
    return end is not None and end <= now
