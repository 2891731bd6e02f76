"""Stand-in for the examples' toy proxy in the test guest: the same arguments and routes.

Routes each completion to the next prefill server (round robin, no health check: a dead
server keeps its turn), asking it for the KV of a remote decode with max_tokens 1, then to the
decode server with the returned KV parameters (remote_host rewritten to the prefill host it
used), and returns the decode server's answer; GET /healthcheck answers 200. Records its argv in
/var/lib/fakes/proxy.jsonl.
"""

from __future__ import annotations

import argparse
import http.server
import itertools
import json
import sys
import time
import urllib.request

sys.path.insert(0, "/usr/local/lib/fakes")
import fakectl


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefiller-hosts", "--prefiller-host", nargs="+", default=["localhost"])
    p.add_argument("--prefiller-ports", "--prefiller-port", nargs="+", type=int, default=[8100])
    p.add_argument("--decoder-hosts", "--decoder-host", nargs="+", default=["localhost"])
    p.add_argument("--decoder-ports", "--decoder-port", nargs="+", type=int, default=[8200])
    args = p.parse_args()
    prefill = itertools.cycle(list(zip(args.prefiller_hosts, args.prefiller_ports, strict=True)))
    decode = itertools.cycle(list(zip(args.decoder_hosts, args.decoder_ports, strict=True)))
    fakectl.record("proxy.jsonl", {"event": "start", "argv": sys.argv, "time": time.time()})

    def post(host: str, port: int, body: dict[str, object]) -> dict[str, object]:
        req = urllib.request.Request(f"http://{host}:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _json(self, doc: object, status: int = 200) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/healthcheck":
                return self._json({"status": "ok"})
            self._json({"error": "not found"}, 404)

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            p_host, p_port = next(prefill)
            d_host, d_port = next(decode)
            # As the examples' proxy: ask prefill for the KV of a remote decode, one token; hand its
            # parameters to decode with remote_host rewritten to the prefill host it used.
            remote = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
            try:
                first = post(p_host, p_port, req | {"max_tokens": 1, "stream": False, "kv_transfer_params": remote})
                params = dict(first.get("kv_transfer_params") or {})
                if params:
                    params["remote_host"] = p_host
                answer = post(d_host, d_port, req | {"kv_transfer_params": params})
            except (OSError, ValueError) as e:
                return self._json({"error": f"toy proxy: {e}"}, 500)
            fakectl.record("proxy.jsonl", {"event": "completion", "prefill": f"{p_host}:{p_port}", "decode": f"{d_host}:{d_port}"})
            self._json(answer)

    http.server.ThreadingHTTPServer.request_queue_size = 1024  # the examples' proxy runs uvicorn (backlog 2048)
    http.server.ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
