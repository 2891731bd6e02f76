"""The fake `vllm` CLI of the test guest: a server's behaviour without Trainium.

`vllm serve MODEL ... --port P`: refuses to start without a checkpoint at MODEL (as vLLM
does), "compiles" for compile_s seconds when the compile cache under ~/.cache/neuron_libtorch
has no graph for its role yet (writing one that later servers find), "loads" for load_s
seconds, then answers GET /health, POST /v1/completions and GET /metrics on P until SIGINT, every
request first through the classes --middleware names, as vLLM does (vllm_middleware.py).
Every start, readiness and stop is recorded with argv and environment in
/var/lib/fakes/vllm-P.jsonl. Settings (fw_cfg section "vllm"): compile_s, load_s,
crash_ports (servers on these ports exit 1 after crash_after_s seconds), hold_compile (a compile
does not end while it is true: the harness releases it through /run/fakes/vllm.json).
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, "/usr/local/lib/fakes")
import fakectl
import vllm_middleware


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    """The value after a flag, as argparse would read it."""
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else default


def serve(argv: list[str]) -> None:
    model = argv[2]
    port = int(flag(argv, "--port", "8000") or 8000)
    kv = json.loads(flag(argv, "--kv-transfer-config", "{}") or "{}")
    role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(kv.get("kv_role"), "single")
    s = fakectl.settings("vllm")
    log = f"vllm-{port}.jsonl"
    fakectl.record(log, {"event": "start", "argv": argv, "env": dict(os.environ), "time": time.time(), "pid": os.getpid(), "role": role})

    def stop(signum: int, frame: Any) -> None:
        fakectl.record(log, {"event": "stop", "signal": signum, "time": time.time(), "pid": os.getpid()})
        os._exit(0)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    if not (Path(model) / "config.json").is_file():
        print(f"fake vllm: no checkpoint at {model}", file=sys.stderr)
        sys.exit(1)
    if port in s.get("crash_ports", []):
        time.sleep(float(s.get("crash_after_s", 2)))
        fakectl.record(log, {"event": "crash", "time": time.time(), "pid": os.getpid()})
        print("fake vllm: simulated crash", file=sys.stderr)
        sys.exit(1)
    cache = Path.home() / ".cache" / "neuron_libtorch" / f"fake-{role}.neff"
    compiled = False
    if not cache.is_file():
        print(f"fake vllm: compiling the {role} graph", flush=True)
        time.sleep(float(s.get("compile_s", 0)))
        while fakectl.settings("vllm").get("hold_compile"):
            time.sleep(1)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(f"compiled by the server on port {port}\n")
        compiled = True
    time.sleep(float(s.get("load_s", 0)))

    served = {"requests": 0, "prompt": 0, "generated": 0, "ttft": 0.0, "running": 0}
    counting = threading.Lock()  # requests in the server (running), as vLLM's gauge counts them
    middlewares = vllm_middleware.load([argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--middleware"])

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _json(self, doc: Any, status: int = 200) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _middleware(self) -> bool:
            """True when a middleware answered the request itself."""
            return vllm_middleware.respond(self, middlewares)

        def do_GET(self) -> None:
            if self._middleware():
                return
            if self.path == "/health":
                return self._json({})
            if self.path == "/metrics":
                # The series of vLLM's /metrics the node's collector reads, counting what this
                # server has served.
                labels = f'{{model_name="{model}"}}'
                body = "".join(
                    f"vllm:{name}{labels} {value}\n"
                    for name, value in (
                        ("num_requests_running", float(served["running"])),
                        ("num_requests_waiting", 0.0),
                        ("kv_cache_usage_perc", 0.05 if served["requests"] else 0.0),
                        ("prompt_tokens_total", float(served["prompt"])),
                        ("generation_tokens_total", float(served["generated"])),
                        ("time_to_first_token_seconds_sum", served["ttft"]),
                        ("time_to_first_token_seconds_count", float(served["requests"])),
                    )
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self._json({"error": "not found"}, 404)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            req = json.loads(self.rfile.read(length) or b"{}")
            if self._middleware():
                return
            if self.path != "/v1/completions":
                return self._json({"error": "not found"}, 404)
            with counting:
                served["running"] += 1
            try:
                self._complete(req)
            finally:
                with counting:
                    served["running"] -= 1

        def _complete(self, req: dict[str, Any]) -> None:
            fakectl.record(log, {"event": "completion", "time": time.time(), "request": req})
            served["requests"] += 1
            served["prompt"] += 6
            served["ttft"] += 0.05
            if role == "prefill":
                # As vLLM's NIXL connector: the side channel's host is whatever VLLM_NIXL_SIDE_CHANNEL_HOST says.
                return self._json({"id": "cmpl-prefill", "choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                                   "kv_transfer_params": {"remote_host": os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
                                                          "remote_port": port, "remote_block_ids": [0]}})
            tokens = int(req.get("max_tokens", 16))
            served["generated"] += tokens
            if req.get("stream") is True:
                # A token stream as vLLM sends one: an event per token, 0.2 s apart, then [DONE]; the connection closes at its end.
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                for i in range(tokens):
                    time.sleep(0.2)
                    self.wfile.write(b"data: " + json.dumps({"id": "cmpl-fake", "choices": [{"index": 0, "text": f" t{i}"}]}).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                return
            self._json({"id": "cmpl-fake", "object": "text_completion", "model": model,
                        "choices": [{"index": 0, "text": " Paris. It is the capital", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 6, "completion_tokens": tokens, "total_tokens": 6 + tokens}})

    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    fakectl.record(log, {"event": "ready", "time": time.time(), "pid": os.getpid(), "compiled": compiled})
    print(f"fake vllm: Application startup complete on port {port}", flush=True)
    server.serve_forever()


def main() -> None:
    argv = sys.argv
    if argv[1:2] == ["serve"] and len(argv) > 2:
        serve(argv)
    else:
        print(f"fake vllm: unsupported command {argv[1:]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
