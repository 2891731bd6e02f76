"""A router node's API gate: HAProxy's configuration, from the spec.

HAProxy (the image's package) listens on serving.proxy.port and passes on only the OpenAI API
and the health routes to the router on 127.0.0.1 (its admin routes answer there alone). It
holds each request whose head and body fit its buffer (serving.proxy.gate.buffer_kib), so that
one answered 500/502/504 by the router (0.1.17 in PD mode answers 500 for a prefill server it
could not reach and does not retry), or whose connection to the router failed, is sent again
through the router before any byte of an answer went out; a longer request passes through as it
arrives and is not retried. A retry budget stops retries while the node's requests are failing
broadly. The body cap is read from Content-Length here and enforced on any body by the router
(--max-payload-size, node_render/command_lines.py).

Its run-time state is one map file (API_MAP): `lame 1` makes /readiness answer 503 and every
answer close its connection (a router about to restart, gptoss-api lame-duck); `drain 1` answers
every new request 503 with `Retry-After: <retry_after>` while what runs ends (a Capacity Block's
end, gptoss-api drain); `fleet <sha>` is
the router's fleet document, which /readiness carries in X-Gptoss-Fleet (the next router of a
roll waits for it). gptoss-api changes both through the admin socket (API_SOCKET), and the file.
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterspec.sections.endpoint import ANONYMOUS, Endpoint
from clusterspec.sections.proxy import REQUEST_TIMEOUT_MAX_S, Proxy
from node_render.paths import ETC, RUN_DIR

# (method, path) a client outside the node may ask for: the OpenAI API the fleet serves and the
# routes the load balancer and operators check. The path is compared exactly, query removed.
API_ROUTES: tuple[tuple[str, str], ...] = (
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
    ("GET", "/health"), ("GET", "/readiness"), ("GET", "/liveness"),
)  # fmt: skip
API_CONFIG = f"{ETC}/haproxy.cfg"
# The node scripts' defaults (gptoss-api) are these: tests/userdata/test_api_gate.py holds them to it.
API_MAP = f"{RUN_DIR}/api.map"
API_SOCKET = f"{RUN_DIR}/haproxy.sock"
FLEET_HEADER = "X-Gptoss-Fleet"
# The API keys (serving.endpoint.auth=keys), written by gptoss-keys from the cluster's secret: the sha256 of each valid
# key (upper-case hex, HAProxy's `hex`) to its name, and the limits of the keys that have their own.
KEYS_MAP = f"{RUN_DIR}/api-keys.map"
KEY_RATE_MAP = f"{RUN_DIR}/api-key-rate.map"
KEY_CONCURRENCY_MAP = f"{RUN_DIR}/api-key-concurrency.map"
KEYS_STATE = f"{RUN_DIR}/api-keys.state"  # gptoss-keys: the digest of what it gave the gate last
# The node's own key (name 'node'): made at each boot by gptoss-api init (root only, in /run), valid at this node's gate
# alone, never in the secret. What the node itself sends through its gate uses it: the deploy gate's test completion
# (gptoss-signal) and the benchmark (OPENAI_API_KEY, which vllm bench sends as Bearer).
NODE_KEY = f"{RUN_DIR}/node-api-key"
NODE_KEY_ENV = f"{RUN_DIR}/node-api-key.env"
NODE_KEY_NAME = "node"
NODE_KEY_PLACEHOLDER = "<the node's own API key>"  # what the plan shows for it
PER_KEY_TABLE = "per_key"
# HAProxy's own HTTP log format (option httplog), with the key's name (never the key) before the request line.
LOG_FORMAT = "%ci:%cp [%tr] %ft %b/%s %TR/%Tw/%Tc/%Tr/%Ta %ST %B %CC %CS %tsc %ac/%fc/%bc/%sc/%rc %sq/%bq key=%[var(txn.key_name)] %{+Q}r"


@dataclass(frozen=True)
class KeyCheck:
    """What the gate checks of each /v1/ request: a valid key (401), its rate and its concurrency (429)."""

    requests_per_s: int
    concurrency: int
    required: bool = True  # False (auth=optional): a request without a key passes, counted as 'anonymous', not limited
    keys_map: str = KEYS_MAP
    rate_map: str = KEY_RATE_MAP
    concurrency_map: str = KEY_CONCURRENCY_MAP

    @classmethod
    def of(cls, endpoint: Endpoint) -> KeyCheck:
        return cls(requests_per_s=endpoint.key_requests_per_s, concurrency=endpoint.key_concurrency, required=endpoint.auth != "optional")


BODY_MARGIN = 64 * 1024
MAX_REWRITE = 16 * 1024  # of each buffer, what HAProxy keeps free to add headers
# What a retry is for (HAProxy's retry-on): a connection to the router that failed, no answer or a
# malformed one, and the router's answers for a server it could not use. Never 429/503 (a full
# queue), never a timeout (the request may still run); never after a byte went out (HAProxy's rule).
RETRY_ON = ("conn-failure", "empty-response", "junk-response", "500", "502", "504")
HAPROXY_ERRORS = (
    (400, "a malformed request"), (408, "the request did not arrive in time"), (500, "the gate failed"),
    (502, "the router gave no valid answer"), (503, "the router is not answering"), (504, "the answer was silent too long"),
)  # fmt: skip


def body_cap(proxy: Proxy, max_model_len: int) -> int:
    """The largest request body a node takes: the model's context in bytes, with room for JSON and chat framing."""
    return max_model_len * proxy.gate.body_bytes_per_token + BODY_MARGIN


def retried_body_bytes(proxy: Proxy) -> int:
    """About the longest body HAProxy holds whole, so can retry: its buffer less the rewrite room and a typical head (1 KiB)."""
    return proxy.gate.buffer_kib * 1024 - MAX_REWRITE - 1024


def open_files(proxy: Proxy) -> int:
    """HAProxy's open-file limit: a client and a router socket per request, the clients' idle ones, and margin."""
    return 2 * (proxy.gate.max_connections + proxy.gate.max_requests) + 256


def _json(status: int, message: str) -> str:
    return f'{{"error":{{"message":"{message}","type":"gptoss_api_gate","code":{status}}}}}'


def api_gate_config(
    proxy: Proxy,
    *,
    max_model_len: int,
    bind: str,
    router_port: int,
    router_host: str = "127.0.0.1",
    api_map: str = API_MAP,
    socket: str = API_SOCKET,
    keys: KeyCheck | None = None,
) -> str:
    """haproxy.cfg of a router node: `bind` HOST:PORT for clients, the router at router_host:router_port (loopback on a
    node); with `keys`, every /v1/ request needs a valid API key and stays within its key's limits."""
    g = proxy.gate
    cap = body_cap(proxy, max_model_len)
    paths = sorted({p for _, p in API_ROUTES})
    allowed = [f"http-request set-var(txn.api_route) bool(true) if {{ method {m} }} {{ path {p} }}" for m, p in API_ROUTES]
    # HAProxy answers an aborted or refused request itself; each answer names why, as JSON.
    lines = [
        "# Rendered from the spec (serving.proxy.gate): the node's API gate in front of its router.",
        "global",
        f"    maxconn {g.max_connections + g.max_requests + 64}",
        f"    stats socket {socket} mode 600 level admin",
        f"    nbthread {g.threads}",
        # A request is retried only if HAProxy holds it whole: one whose head and body fit the buffer (less its rewrite room).
        f"    tune.bufsize {g.buffer_kib * 1024}",
        f"    tune.maxrewrite {MAX_REWRITE}",
        # A reload or stop lets the streams it holds end: the router's request timeout ends each (run-time
        # data, from the fleet's document), this only bounds it by the spec's longest.
        f"    hard-stop-after {REQUEST_TIMEOUT_MAX_S + 30}s",
        "    log stdout format short daemon notice",
        "",
        "defaults",
        "    mode http",
        "    log global",
        # With keys, HAProxy's own HTTP log format and each request's key name (LOG_FORMAT).
        *([f'    log-format "{LOG_FORMAT}"'] if keys else ["    option httplog"]),
        "    option dontlognull",
        # Only what went wrong (an error, a retry, a timeout, a refusal) is logged: a line per request costs CPU the router needs.
        "    option dontlog-normal",
        # ... at the level err, which the log's notice level lets through (HAProxy logs traffic at info otherwise, and drops it here).
        "    option log-separate-errors",
        f"    timeout http-request {g.head_timeout_s}s",
        "    timeout http-keep-alive 60s",
        f"    timeout client {g.idle_timeout_s}s",
        f"    timeout server {g.idle_timeout_s}s",
        "    timeout connect 2s",
        "    timeout client-fin 30s",
        # HAProxy's own answers (a head too slow, no router, an answer too slow) in the API's JSON form.
        *[
            f"    http-error status {code} content-type application/json string '{_json(code, why)}'"
            for code, why in HAPROXY_ERRORS
        ],
        "",
        # One entry: the node's request and failure rates, the retry budget's.
        "backend retry_budget",
        "    stick-table type integer size 1 expire 60s store http_req_rate(10s),http_fail_rate(10s)",
        "",
        *(_key_table() if keys else []),
        "frontend api",
        f"    bind {bind}",
        f"    maxconn {g.max_connections}",
        "    option http-buffer-request",
        "    http-request track-sc0 int(0) table retry_budget",
        f"    acl lame_duck str(lame),map({api_map},0) -m str 1",
        "    acl readiness path /readiness",
        *[f"    {a}" for a in allowed],
        *[f"    acl known_path path {p}" for p in paths],
        "    http-request set-var(txn.readiness) bool(true) if readiness",
        f"    http-request return status 404 content-type application/json string '{_json(404, 'not served here (only the OpenAI API and the health routes)')}' if !known_path",
        f"    http-request return status 405 content-type application/json string '{_json(405, 'method not served on this path')}' if !{{ var(txn.api_route) -m bool }}",
        *(_key_rules(keys) if keys else []),
        f"    http-request return status 413 content-type application/json string '{_json(413, f'request body over {cap} bytes')}' if {{ req.hdr_val(content-length) gt {cap} }}",
        # Draining before a Capacity Block's end: nothing new is taken (readiness included), what runs ends.
        f"    acl draining str(drain),map({api_map},0) -m str 1",
        f"    http-request return status 503 content-type application/json string '{_json(503, 'draining: this node leaves before its capacity ends; retry later')}' hdr Retry-After %[str(retry_after),map({api_map},600)] if draining",
        f"    http-request return status 503 content-type application/json string '{_json(503, 'draining: this node restarts its router')}' if readiness lame_duck",
        f"    http-request return status 503 content-type application/json string '{_json(503, f'this node serves {g.max_requests} requests at once; retry')}' hdr Retry-After 1 if {{ be_conn(router) ge {g.max_requests} }}",
        "    http-request del-header Connection",
        "    default_backend router",
        f"    http-after-response set-header {FLEET_HEADER} %[str(fleet),map({api_map},none)] if {{ var(txn.readiness) -m bool }}",
        # Lame-duck: each answer closes its connection, so a client's next request opens a new one, which the load balancer sends elsewhere.
        "    http-after-response set-header Connection close if lame_duck || draining",
        "",
        "backend router",
        # One server, the node's own router on loopback, with no state bound to a connection: every request may
        # take an idle one (a client's first too). One the router had just closed fails before any byte: retried if
        # the request fits the buffer.
        "    http-reuse always",
        f"    retries {g.retries}",
        *([f"    retry-on {' '.join(RETRY_ON)}"] if g.retries else []),
        # The budget: retries stop while more than retry_budget_percent of the last 10 s's requests failed (10 at least).
        "    http-request set-var(txn.requests) sc_http_req_rate(0)",
        "    http-request set-var(txn.failed) sc_http_fail_rate(0)",
        f"    http-request set-var(txn.allowed) var(txn.requests),mul({g.retry_budget_percent})",
        "    http-request set-var(txn.over) var(txn.failed),mul(100),sub(txn.allowed)",
        "    http-request disable-l7-retry if { var(txn.failed) -m int ge 10 } { var(txn.over) -m int gt 0 }",
        f"    server router {router_host}:{router_port}",
        "",
    ]
    return "\n".join(lines)


def _key_table() -> list[str]:
    """One entry per key name: its rate and concurrency (the limits), its counts (gptoss-telemetry publishes them)."""
    return [
        f"backend {PER_KEY_TABLE}",
        "    stick-table type string len 64 size 10k expire 24h store http_req_rate(1s),conn_cur,http_req_cnt,http_fail_cnt,bytes_out_cnt,gpc0",
        "",
    ]


def _key_rules(k: KeyCheck) -> list[str]:
    """A /v1/ request without `Authorization: Bearer <a valid key>` is answered 401 (WWW-Authenticate: Bearer) here; one
    over its key's rate or concurrency 429 with Retry-After: 1. The key never goes further than the gate: the router and
    the logs see its name alone."""
    bearer = "{ req.fhdr(authorization),word(1,' ') -m str -i bearer }"
    # auth=optional: a request that sends no Authorization at all passes, counted under ANONYMOUS and never limited.
    anonymous = [f"    http-request set-var(txn.key_name) str({ANONYMOUS}) if api_call !{{ req.fhdr(authorization) -m found }}"]
    unlimited = "" if k.required else f" !{{ var(txn.key_name) -m str {ANONYMOUS} }}"
    return [
        "    acl api_call path_beg /v1/",
        f"    http-request set-var(txn.key_name) req.fhdr(authorization),word(2,' '),sha2(256),hex,map({k.keys_map}) if api_call {bearer}",
        *([] if k.required else anonymous),
        f"    http-request return status 401 content-type application/json string '{_json(401, 'a valid API key is required: Authorization: Bearer <key>')}' hdr WWW-Authenticate Bearer if api_call !{{ var(txn.key_name) -m found }}",
        f"    http-request track-sc1 var(txn.key_name) table {PER_KEY_TABLE} if api_call",
        f"    http-request set-var(txn.key_rate) var(txn.key_name),map_str_int({k.rate_map},{k.requests_per_s}) if api_call",
        f"    http-request set-var(txn.key_concurrency) var(txn.key_name),map_str_int({k.concurrency_map},{k.concurrency}) if api_call",
        "    acl key_over_rate sc_http_req_rate(1),sub(txn.key_rate) gt 0",
        "    acl key_over_concurrency sc_conn_cur(1),sub(txn.key_concurrency) gt 0",
        # Each refusal counted in the key's gpc0 (its Limited count, published with its requests).
        f"    http-request sc-inc-gpc0(1) if api_call key_over_rate{unlimited} || api_call key_over_concurrency{unlimited}",
        f"    http-request return status 429 content-type application/json string '{_json(429, 'over this API key requests per second; retry')}' hdr Retry-After 1 if api_call key_over_rate{unlimited}",
        f"    http-request return status 429 content-type application/json string '{_json(429, 'over this API key concurrent requests; retry')}' hdr Retry-After 1 if api_call key_over_concurrency{unlimited}",
        "    http-request del-header Authorization",
    ]


def api_gate_unit(proxy: Proxy, *, bin_dir: str, restart_sec: int, keys: bool = False) -> dict[str, object]:
    """The values of gptoss-api.service's template (userdata/units)."""
    return {
        "keys": keys, "bin": bin_dir, "version": proxy.gate.haproxy_version, "port": proxy.port, "router_port": proxy.router.internal_port,
        "config": API_CONFIG, "open_files": open_files(proxy),
        "backoff_s": proxy.restart_backoff_s, "backoff_max_s": proxy.restart_backoff_max_s,
        # A start may install the package (apt, up to 600 s) after its back-off.
        "start_timeout_s": proxy.restart_backoff_max_s + 660,
        # A stop lets the streams end (hard-stop-after in the configuration).
        "stop_timeout_s": REQUEST_TIMEOUT_MAX_S + 60,
        "restart_sec": restart_sec,
    }  # fmt: skip


def gate_summary(proxy: Proxy, max_model_len: int) -> dict[str, object]:
    """What `plan` says of a router node's API gate (and --json holds)."""
    g = proxy.gate
    return {"haproxy": g.haproxy_version, "retries": g.retries, "retry_on": list(RETRY_ON) if g.retries else [],
            "retried_bodies_up_to": retried_body_bytes(proxy) if g.retries else 0, "body_cap": body_cap(proxy, max_model_len),
            "retry_budget_percent": g.retry_budget_percent, "max_requests": g.max_requests, "lame_duck_s": g.lame_duck_s}  # fmt: skip
