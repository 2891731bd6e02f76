"""Who may call the model: the API gate with keys (serving.endpoint.auth=keys), as a router node runs it.

The real HAProxy with the configuration the spec renders, the node's own gptoss-keys reading the
cluster's secret with the real AWS CLI from a moto server, and `gptoss keys` (cluster_ops.api_keys)
editing that secret with boto3: what a key, a wrong key, a rotation, a revocation and a key over its
limits get, counted at the client and at the router's stand-in (what the gate refuses never reaches it).
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import boto3
import pytest

from cluster_ops.api_keys import Keys, KeysError
from node_render.haproxy import KeyCheck
from tests.api_gate import Gate, start_gate
from tests.conftest import ROOT
from tests.userdata.api_gate_peers import MAX_MODEL_LEN, Upstream, _port, _proxy, request

KEYS_SCRIPT = ROOT / "userdata" / "bin" / "gptoss-keys"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-2", "AWS_DEFAULT_REGION": "us-east-2"}
NOW = dt.datetime.now(dt.UTC)
# The test's limits: low enough to reach with a few requests.
RATE, CONCURRENCY = 5, 3


class KeyedGate:
    """The gate with keys, its secret in moto, and the node's sync."""

    def __init__(self, tmp: Path, upstream: Upstream, moto_url: str, *, required: bool = True) -> None:
        folder = tmp / "gate"
        self.check = KeyCheck(requests_per_s=RATE, concurrency=CONCURRENCY, required=required, keys_map=str(folder / "api-keys.map"),
                              rate_map=str(folder / "api-key-rate.map"), concurrency_map=str(folder / "api-key-concurrency.map"))  # fmt: skip
        self.gate: Gate = start_gate(folder, _proxy(max_requests=64), host="127.0.0.1", port=_port(),
                                     router_port=upstream.server_address[1], max_model_len=MAX_MODEL_LEN, keys=self.check)  # fmt: skip
        self.secret = f"gptoss/keys-test-{os.getpid()}-{time.monotonic_ns()}/api-keys"
        self.client = boto3.client("secretsmanager", endpoint_url=moto_url, region_name="us-east-2",
                                   aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip
        # As the stack makes it: one generated key, 'initial'.
        self.client.create_secret(Name=self.secret, SecretString=json.dumps({"keys": [], "initial": "i" * 48}))
        self.keys = Keys(self.client, self.secret)
        self.env = self.gate.env | CREDS | {
            "AWS_ENDPOINT_URL": moto_url, "GPTOSS_KEYS_SECRET": self.secret, "GPTOSS_KEYS_MAP": self.check.keys_map,
            "GPTOSS_KEY_RATE_MAP": self.check.rate_map, "GPTOSS_KEY_CONCURRENCY_MAP": self.check.concurrency_map,
            "GPTOSS_KEYS_STATE": str(folder / "api-keys.state"),
        }  # fmt: skip
        self.port = self.gate.port

    def gate_table(self) -> dict[str, dict[str, int]]:
        """The per-key table, from HAProxy's admin socket: {name: {counter: value}}."""
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(self.gate.socket_dir / "haproxy.sock"))
            s.sendall(b"show table per_key\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        rows = {}
        for line in out.decode().splitlines()[1:]:
            if " key=" not in line:
                continue
            fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
            rows[fields.pop("key")] = {k: int(v) for k, v in fields.items() if v.isdigit()}
        return rows

    def sync(self, expect: int = 0, **extra: str) -> subprocess.CompletedProcess[str]:
        """What gptoss-keys.timer runs on the node every keys_refresh_s."""
        res = subprocess.run([str(KEYS_SCRIPT), "sync"], env=self.env | extra, capture_output=True, text=True, timeout=120)
        assert res.returncode == expect, res.stdout + res.stderr
        return res


@pytest.fixture
def keyed(upstream: Upstream, tmp_path: Path, moto_url: str) -> Any:
    k = KeyedGate(tmp_path, upstream, moto_url)
    yield k
    k.gate.stop()


def call(port: int, key: str | None, path: str = "/v1/completions", **doc: Any) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    status, body, head = request(port, "POST", path, json.dumps({"model": "m", "prompt": "p", **doc}).encode(), headers)
    return status, head, body


def test_no_key_or_a_wrong_one_is_refused_401_before_the_router_and_a_valid_one_passes_without_its_key(keyed: KeyedGate, upstream: Upstream) -> None:
    keyed.sync()
    for key in (None, "", "not-a-key-of-this-cluster-at-all", "i" * 47):
        status, head, body = call(keyed.port, key)
        assert status == 401, (key, status, body)
        assert head["www-authenticate"] == "Bearer"
        assert json.loads(body)["error"]["code"] == 401
    # The scheme must be Bearer (any case); Basic with the right key is not a key.
    status, _, _ = request(keyed.port, "POST", "/v1/completions", b"{}", {"Authorization": "Basic " + "i" * 48})
    assert status == 401
    assert upstream.seen == [], "a refused request reached the router"
    assert call(keyed.port, "i" * 48)[0] == 200
    assert request(keyed.port, "POST", "/v1/completions", b"{}", {"Authorization": "bearer " + "i" * 48})[0] == 200
    # The health routes the load balancer checks take no key.
    assert request(keyed.port, "GET", "/readiness")[0] == 200
    assert [h.get("authorization") for _, _, h, _ in upstream.seen] == [None, None, None], "the key went past the gate"


def test_a_created_key_works_after_the_nodes_next_read_and_a_revoked_one_is_refused_after_it(keyed: KeyedGate, upstream: Upstream) -> None:
    keyed.sync()
    key = keyed.keys.create("team-search", NOW)
    assert call(keyed.port, key)[0] == 401, "before the node read the secret again"
    out = keyed.sync().stdout
    assert "2 keys of the secret valid (initial, team-search) and the node's own" in out, out
    assert call(keyed.port, key)[0] == 200
    assert keyed.keys.revoke("team-search", NOW) == 1
    assert call(keyed.port, key)[0] == 200, "until the node's next read (keys_refresh_s, at most 60 s)"
    keyed.sync()
    status, head, _ = call(keyed.port, key)
    assert (status, head["www-authenticate"]) == (401, "Bearer")
    assert call(keyed.port, "i" * 48)[0] == 200, "the other keys still hold"
    # No key is written to the node's disk: the maps hold sha256 and names.
    c = keyed.check
    on_disk = "".join(Path(p).read_text() for p in (c.keys_map, c.rate_map, c.concurrency_map))
    assert key not in on_disk and "i" * 48 not in on_disk and "initial" in on_disk


def test_the_nodes_own_key_holds_from_the_gates_start_here_alone_and_no_secret_can_take_its_name(keyed: KeyedGate, tmp_path: Path) -> None:
    """What the node sends through its own gate (the deploy gate's test completion, the benchmark's OPENAI_API_KEY):
    gptoss-api init made its key before HAProxy started (root only), every read of the secret keeps it."""
    folder = keyed.gate.folder
    key = (folder / "node-api-key").read_text().strip()
    assert key.startswith("gk-node-") and len(key) == 51
    assert (folder / "node-api-key").stat().st_mode & 0o777 == 0o600 and (folder / "node-api-key.env").stat().st_mode & 0o777 == 0o600
    assert (folder / "node-api-key.env").read_text() == f"OPENAI_API_KEY={key}\n"
    assert call(keyed.port, key)[0] == 200, "before the first read of the secret"
    # A key the secret names 'node' is not the node's: skipped, and the node's own stays.
    doc = {"keys": [{"name": "node", "key": "s" * 40, "created": "2026-12-07T00:00:00Z", "expires": None}], "initial": None}
    keyed.client.put_secret_value(SecretId=keyed.secret, SecretString=json.dumps(doc))
    keyed.sync()
    assert call(keyed.port, key)[0] == 200 and call(keyed.port, "s" * 40)[0] == 401 and call(keyed.port, "i" * 48)[0] == 401
    with pytest.raises(KeysError, match="router node's own key"):
        keyed.keys.create("node", NOW)


def test_a_node_that_cannot_read_the_secret_keeps_the_keys_it_has_and_says_why(keyed: KeyedGate) -> None:
    keyed.sync()
    res = keyed.sync(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_MAX_ATTEMPTS="1")
    assert "could not read the secret" in res.stdout and "keeps the keys it has" in res.stdout, res.stdout
    assert call(keyed.port, "i" * 48)[0] == 200
    keyed.client.put_secret_value(SecretId=keyed.secret, SecretString="[not the keys' form]")
    res = keyed.sync()
    assert "is not of the keys' form" in res.stdout, res.stdout
    assert call(keyed.port, "i" * 48)[0] == 200
    # Once the keys it holds are older than GPTOSS_KEYS_STALE_S, a failed read fails the unit (UnitsNotReady pages).
    res = keyed.sync(expect=1, AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_MAX_ATTEMPTS="1", GPTOSS_KEYS_STALE_S="0")
    assert "the keys this gate holds are" in res.stdout and "does not hold here until the secret can be read again" in res.stdout
    assert call(keyed.port, "i" * 48)[0] == 200, "the gate still serves with the keys it has"


def test_a_rotation_under_32_streaming_clients_fails_no_request(keyed: KeyedGate, upstream: Upstream) -> None:
    """32 clients stream completions with team-a's key; the operator rotates it (the old key valid 6 s more), the node
    reads the secret, each client takes the new key; the grace ends and the node reads again: every stream was answered
    200 and delivered its events, and the old key is refused at the end."""
    # Its own limits, far above what 32 clients send (the rotation keeps them for the new key).
    old = keyed.keys.create("team-a", dt.datetime.now(dt.UTC), requests_per_s=100000, concurrency=1000)
    keyed.sync()
    upstream.first_chunk_read.set()  # the stand-in streams on without waiting for a reader
    current = {"key": old}
    stop = threading.Event()
    results: list[tuple[int, int]] = []
    by_key: dict[str, int] = {}
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", keyed.port, timeout=30)
            status, events, key = 0, 0, current["key"]
            try:
                conn.request("POST", "/v1/chat/completions", body=b'{"stream": true}',
                             headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})  # fmt: skip
                resp = conn.getresponse()
                status = resp.status
                while status == 200 and events < 3 and (line := resp.readline()):
                    events += line.startswith(b"data:")
            except OSError:
                pass
            finally:
                conn.close()
            with lock:
                results.append((status, events))
                by_key[key] = by_key.get(key, 0) + 1
            stop.wait(0.5)  # a client's pace: bounded work, about 64 streams a second in all

    threads = [threading.Thread(target=client) for _ in range(32)]
    for t in threads:
        t.start()
    time.sleep(1)
    new, _ = keyed.keys.rotate("team-a", dt.datetime.now(dt.UTC), grace_s=6)
    keyed.sync()
    current["key"] = new  # each client's next request
    time.sleep(7)  # the grace ends
    keyed.sync()
    time.sleep(1)
    stop.set()
    for t in threads:
        t.join(60)
    failed = [r for r in results if r != (200, 3)]
    print(f"rotation under 32 streaming clients: {len(results)} streams, {len(failed)} failed")
    # Both keys carried streams (the old one before the switch, the new one after), and none failed.
    assert failed == [] and by_key.get(old, 0) >= 32 and by_key.get(new, 0) >= 32, (len(results), by_key.values(), failed[:5])
    assert call(keyed.port, old)[0] == 401, "the old key outlived its grace"
    assert call(keyed.port, new)[0] == 200


def test_a_key_over_its_rate_or_concurrency_gets_429_with_retry_after_and_other_keys_are_not_affected(keyed: KeyedGate, upstream: Upstream) -> None:
    now = dt.datetime.now(dt.UTC)
    busy = keyed.keys.create("busy", now)
    calm = keyed.keys.create("calm", now)
    wide = keyed.keys.create("wide", now, requests_per_s=1000, concurrency=2)
    keyed.sync()
    # RATE requests a second per key: a burst of 12 gets RATE answered, then 429 with Retry-After: 1, at once.
    answers = [call(keyed.port, busy) for _ in range(12)]
    assert [a[0] for a in answers] == [200] * RATE + [429] * (12 - RATE), [a[0] for a in answers]
    assert all(a[1]["retry-after"] == "1" for a in answers if a[0] == 429)
    assert "requests per second" in json.loads(answers[-1][2])["error"]["message"]
    assert call(keyed.port, calm)[0] == 200, "another key in the same second is served"
    time.sleep(2.5)
    assert call(keyed.port, busy)[0] == 200, "the key is served again once its rate fell"
    # Concurrency: the key's own limit (2) over the default; 4 slow requests at once, 2 served and 2 refused.
    out: list[int] = []
    threads = [threading.Thread(target=lambda: out.append(call(keyed.port, wide, sleep=1.5)[0])) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert call(keyed.port, calm)[0] == 200, "another key while this one is at its concurrency"
    for t in threads:
        t.join(30)
    assert sorted(out) == [200, 200, 429, 429], out
    refused = sum(1 for a in answers if a[0] == 429) + 2
    served = len([s for s in upstream.seen if s[1] == "/v1/completions"])
    assert served == RATE + 1 + 1 + 1 + 2, served  # busy's 5 and 1, calm's 2, wide's 2: no refused one reached the router
    # Each refusal is counted for its key (gpc0), and its name, never the key, is in the gate's log.
    table = keyed.gate_table()
    assert table["busy"]["gpc0"] == refused - 2 and table["wide"]["gpc0"] == 2, table
    # A request that failed (the router's stand-in answers 502 to each of its 3 attempts) is logged with its key's name.
    assert call(keyed.port, calm, answers=[502, 502, 502], id="failing")[0] == 502
    time.sleep(0.5)
    log = (keyed.gate.folder / "haproxy.log").read_text()
    failed_lines = [line for line in log.splitlines() if " 502 " in line]
    assert failed_lines and all("key=calm" in line for line in failed_lines), log[-2000:]
    assert busy not in log and calm not in log and wide not in log, "a key in the gate's log"


def test_auth_optional_lets_a_request_without_a_key_pass_uncounted_against_limits_and_still_checks_a_key_that_is_sent(
    upstream: Upstream, tmp_path: Path, moto_url: str
) -> None:
    """The way to keys for a cluster whose clients send none: without Authorization a request passes (as 'anonymous',
    counted, never limited); a wrong key is still 401; a valid key is limited as with auth=keys."""
    k = KeyedGate(tmp_path, upstream, moto_url, required=False)
    try:
        k.sync()
        assert [call(k.port, None)[0] for _ in range(12)] == [200] * 12, "no key: served, however many"
        assert call(k.port, "not-a-key-of-this-cluster-at-all")[0] == 401
        assert [call(k.port, "i" * 48)[0] for _ in range(RATE + 2)] == [200] * RATE + [429, 429]
        table = k.gate_table()
        assert table["anonymous"]["http_req_cnt"] == 12 and table["anonymous"]["gpc0"] == 0, table
        with pytest.raises(KeysError, match="requests without a key"):
            k.keys.create("anonymous", NOW)
    finally:
        k.gate.stop()
