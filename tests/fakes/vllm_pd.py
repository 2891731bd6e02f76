#!/usr/bin/env python3
"""Loopback stand-ins for vLLM servers in a NIXL prefill/decode pair, strict about the handoff.

A prefill server answers POST /v1/completions only when the request asks for a remote decode
(`kv_transfer_params.do_remote_decode` true) and `max_tokens` 1, as a NIXL proxy or router
must send it; it returns the KV transfer parameters a vLLM kv_producer returns: its engine id,
blocks derived from the prompt, and `remote_host` from its own VLLM_NIXL_SIDE_CHANNEL_HOST
(as vLLM reports its side channel). A decode server answers only when the request carries
exactly the parameters that prefill server returned for that prompt (it recomputes them) and
`remote_host` is that prefill server's node address: a proxy that forwards a wildcard
address (0.0.0.0) would send the KV handshake nowhere. Anything else is answered 400 and
counted as a violation.

Both answer GET /health, GET /metrics (vLLM's gauges of running and waiting requests and KV
cache use, under vLLM's names) and GET /stats (requests served, violations, request times, the
time each request waited for an engine slot, and every path asked but /health and /stats; a
path vLLM's API server does not serve, e.g. SGLang's /get_load, is answered 404 as vLLM does). Latency per role is a flag,
plus a cost per token (prefill: per word of the prompt; decode: per output token). An engine of
--slots slots runs that many requests at once and queues the rest, as vLLM's scheduler does past
max_num_seqs. Standard library only.

    python3 vllm_pd.py --role prefill|decode --host IP --port P [--side-channel-port N]
                       [--latency-ms MS] [--ms-per-token MS] [--slots N] [--engines JSON]
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_middleware


def engine_id(host: str, port: int) -> str:
    """The engine id a prefill server reports (its address)."""
    return f"engine-{host}:{port}"


def expected_params(prompt: str, engine: str, remote_host: str, remote_port: int) -> dict[str, Any]:
    """What a prefill server returns for a prompt: decode must receive exactly this."""
    digest = hashlib.sha256(f"{engine}|{prompt}".encode()).digest()
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine,
        "remote_block_ids": [digest[0], digest[1], digest[2]],
        "remote_host": remote_host,
        "remote_port": remote_port,
        "tp_size": 4,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--side-channel-port", type=int, default=5559)
    p.add_argument("--latency-ms", type=float, default=0)
    p.add_argument("--ms-per-token", type=float, default=0)
    p.add_argument("--stream-ms-per-token", type=float, default=20, help="pause before each event of a stream")
    p.add_argument("--slots", type=int, default=0, help="requests the engine runs at once (0: no limit)")
    # vLLM's API server tokenizes a prompt on its one event loop, which also answers /health: a burst of
    # long prompts delays /health (upstream reports seconds). ms of loop time per prompt word.
    p.add_argument("--loop-ms-per-word", type=float, default=0)
    # A hung engine: from this many seconds after start no completion finishes, while /health still answers.
    p.add_argument("--hang-after-s", type=float, default=None)
    # decode: {engine id: [node address, side channel port]} of every prefill server.
    p.add_argument("--engines", default="{}")
    # vLLM's --middleware: every request goes through these classes first (tests/fakes/vllm_middleware.py).
    p.add_argument("--middleware", action="append", default=[])
    args = p.parse_args()
    middlewares = vllm_middleware.load(args.middleware)
    engines = json.loads(args.engines)
    side_host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
    lock = threading.Lock()
    stats: dict[str, Any] = {"served": 0, "violations": [], "times": [], "waits_ms": [], "asked": {}}
    slots = threading.BoundedSemaphore(args.slots) if args.slots else None
    busy = [0]  # completions in the server: running and waiting for a slot
    tokens_total = {"prompt": 0, "generation": 0}  # vLLM's counters, as its /metrics shows them
    started = time.monotonic()
    event_loop = threading.Lock()  # the API server's one loop: prompt tokenization and /health take turns

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes: without this, Nagle and the client's delayed ACK
        # hold every keep-alive answer ~40 ms.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _json(self, doc: Any, status: int = 200) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _violation(self, why: str) -> None:
            with lock:
                stats["violations"].append(why)
            self._json({"error": why}, 400)

        def _middleware(self) -> bool:
            """True when a middleware answered the request itself."""
            return vllm_middleware.respond(self, middlewares)

        def do_GET(self) -> None:
            if self._middleware():
                return
            if self.path == "/health":
                with event_loop:
                    pass
                return self._json({})
            if self.path == "/stats":
                with lock:
                    return self._json(stats)
            if self.path == "/metrics":
                # vLLM's Prometheus page, with the scheduler's gauges of this engine (running, waiting).
                with lock:
                    running = min(busy[0], args.slots) if args.slots else busy[0]
                    waiting = busy[0] - running
                    stats["asked"][self.path] = stats["asked"].get(self.path, 0) + 1
                    prompt_total, generation_total = tokens_total["prompt"], tokens_total["generation"]
                text = ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                        "# TYPE vllm:num_requests_running gauge\n"
                        f'vllm:num_requests_running{{engine="0",model_name="gpt-oss"}} {running}.0\n'
                        f'vllm:num_requests_waiting{{engine="0",model_name="gpt-oss"}} {waiting}.0\n'
                        f'vllm:kv_cache_usage_perc{{engine="0",model_name="gpt-oss"}} {running / (args.slots or 1):.2f}\n'
                        f'vllm:prompt_tokens_total{{engine="0",model_name="gpt-oss"}} {prompt_total}.0\n'
                        f'vllm:generation_tokens_total{{engine="0",model_name="gpt-oss"}} {generation_total}.0\n').encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
                return None
            with lock:
                stats["asked"][self.path] = stats["asked"].get(self.path, 0) + 1
            self._json({"detail": "Not Found"}, 404)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self._middleware():
                return
            if self.path != "/v1/completions":
                return self._json({"error": "not found"}, 404)
            req = json.loads(body or b"{}")
            prompt = str(req.get("prompt", ""))
            kv = req.get("kv_transfer_params") or {}
            tokens = len(prompt.split()) if args.role == "prefill" else int(req.get("max_tokens", 16))
            if args.loop_ms_per_word:
                with event_loop:
                    time.sleep(args.loop_ms_per_word * len(prompt.split()) / 1000)
            queued = time.monotonic()
            with lock:
                busy[0] += 1
            if slots is not None:
                slots.acquire()
            waited = time.monotonic() - queued
            try:
                time.sleep((args.latency_ms + args.ms_per_token * tokens) / 1000)
                while args.hang_after_s is not None and time.monotonic() - started >= args.hang_after_s:
                    time.sleep(1)  # the engine makes no progress; the request stays in it
                with lock:
                    tokens_total["prompt"] += len(prompt.split())
                    tokens_total["generation"] += 1 if args.role == "prefill" else tokens
            finally:
                if slots is not None:
                    slots.release()
                with lock:
                    busy[0] -= 1
            if args.role == "prefill":
                if kv.get("do_remote_decode") is not True or req.get("max_tokens") != 1:
                    return self._violation(f"prefill got max_tokens={req.get('max_tokens')} kv_transfer_params={kv}")
                params = expected_params(prompt, engine_id(args.host, args.port), side_host, args.side_channel_port)
                answer = {"id": "cmpl-prefill", "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                          "kv_transfer_params": params}  # fmt: skip
            else:
                engine = kv.get("remote_engine_id")
                if engine not in engines:
                    return self._violation(f"decode got an unknown or missing engine: kv_transfer_params={kv}")
                node, side_port = engines[engine]
                if kv != expected_params(prompt, engine, node, side_port):
                    return self._violation(f"decode got kv_transfer_params={kv}, not what {engine} returned for this prompt")
                answer = {"id": "cmpl-decode", "object": "text_completion", "model": req.get("model"),
                          "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                          "usage": {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": 4 + tokens}}  # fmt: skip
            with lock:
                stats["served"] += 1
                stats["times"].append(round(time.time(), 3))
                stats["waits_ms"].append(round(waited * 1000, 1))
            if args.role == "decode" and req.get("stream") is True:
                return self._stream(tokens, args.stream_ms_per_token)
            self._json(answer)

        def _stream(self, tokens: int, ms_per_token: float) -> None:
            """A token stream as vLLM sends one: server-sent events, one per token, then [DONE]; the connection closes at its end."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            for i in range(tokens):
                time.sleep(ms_per_token / 1000)
                event = {"id": "cmpl-decode", "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    http.server.ThreadingHTTPServer.request_queue_size = 1024  # a listen backlog like uvicorn's, not socketserver's 5
    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"ready {args.role} {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
