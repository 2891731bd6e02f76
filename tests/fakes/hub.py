#!/usr/bin/env python3
"""A local stand-in for the Hugging Face Hub, for the real `huggingface_hub` client.

It serves the few routes `snapshot_download` uses (repository info, tree listing, file
metadata and file download) for repositories laid out in a folder:
`ROOT/<org>/<name>/<files>`. Standard library only: the tests run it on loopback and the VM
guest image runs it for the node's staging script (HF_ENDPOINT points the library here).

Fault injection, for the staging tests: with FAIL_FILE naming a file, the first FAIL_TIMES
downloads of that file send half of it and then close the connection.

History (tests only): ROOT is the repositories' main at COMMIT; `revisions` maps an older
commit to another folder of the same layout. A revision that is neither main, COMMIT nor one of
those is not found. With `ignore_revision` the Hub answers every revision with main (a changed
upstream that a pinned node must refuse).

    python3 hub.py --root DIR [--port 0] [--fail-file F --fail-times N] [--ready-file PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import threading
import urllib.parse
from pathlib import Path
from typing import Any

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    """Repositories on disk, and the requests the server has seen."""

    def __init__(
        self, root: Path, fail_file: str | None = None, fail_times: int = 0, on_download: Any = None,
        revisions: dict[str, Path] | None = None, ignore_revision: bool = False,
    ) -> None:  # fmt: skip
        self.root = root
        self.revisions = revisions or {}
        self.ignore_revision = ignore_revision
        self.fail_file = fail_file
        self.fail_left = fail_times
        self.lock = threading.Lock()
        self.downloads: list[str] = []
        # on_download(file, complete, the request's Authorization header or None)
        self.on_download = on_download or (lambda name, complete, auth: None)

    def repo(self, repo_id: str, revision: str = "main") -> tuple[Path, str] | None:
        """The folder of REPO_ID at REVISION and the commit it is, or None."""
        if self.ignore_revision or revision in ("main", COMMIT):
            root, commit = self.root, COMMIT
        elif revision in self.revisions:
            root, commit = self.revisions[revision], revision
        else:
            return None
        path = (root / repo_id).resolve()
        if root.resolve() not in path.parents or not path.is_dir():
            return None
        return path, commit

    def files(self, repo: Path) -> list[Path]:
        return sorted(p for p in repo.rglob("*") if p.is_file())

    def should_fail(self, name: str) -> bool:
        with self.lock:
            if self.fail_file == name and self.fail_left > 0:
                self.fail_left -= 1
                return True
            return False


def _etag(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Handler(http.server.BaseHTTPRequestHandler):
    hub: Hub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the tests read what was downloaded from Hub.downloads."""

    def _json(self, doc: Any, commit: str, status: int = 200) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        self.wfile.write(body)

    def _not_found(self) -> None:
        body = b'{"error": "Repository Not Found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self) -> tuple[str, list[str]]:
        path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)
        return path, [p for p in path.split("/") if p]

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _serve(self, *, head: bool) -> None:
        _, parts = self._route()
        # /api/models/{org}/{name}[/revision/{rev}] and /api/models/{org}/{name}/tree/{rev}[/{path}]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            rest = parts[4:]
            found = self.hub.repo("/".join(parts[2:4]), rest[1] if len(rest) >= 2 and rest[0] in ("revision", "tree") else "main")
            if found is None:
                return self._not_found()
            repo, commit = found
            if not rest or rest[0] == "revision":
                return self._json(
                    {
                        "id": "/".join(parts[2:4]),
                        "modelId": "/".join(parts[2:4]),
                        "sha": commit,
                        "private": False,
                        "siblings": [{"rfilename": str(p.relative_to(repo))} for p in self.hub.files(repo)],
                    },
                    commit,
                )
            if rest[0] == "tree":
                sub = "/".join(rest[2:])
                entries = []
                for p in self.hub.files(repo):
                    rel = str(p.relative_to(repo))
                    if sub and not rel.startswith(sub + "/"):
                        continue
                    entries.append({"type": "file", "path": rel, "size": p.stat().st_size, "oid": _etag(p)[:40]})
                return self._json(entries, commit)
            return self._not_found()
        # /{org}/{name}/resolve/{rev}/{file...}
        if len(parts) >= 5 and parts[2] == "resolve":
            found = self.hub.repo("/".join(parts[:2]), parts[3])
            name = "/".join(parts[4:])
            target = found[0] / name if found else None
            if target is None or not target.is_file():
                return self._not_found()
            data = target.read_bytes()
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and not head:
                start = int(rng[6:].split("-")[0] or 0)
            status = 206 if start else 200
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data) - start))
            self.send_header("ETag", f'"{_etag(target)}"')
            self.send_header("X-Repo-Commit", found[1] if found else COMMIT)
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if head:
                return
            if self.hub.should_fail(name):
                # Half the file, then the connection drops: a download that fails half-way.
                self.wfile.write(data[start : start + (len(data) - start) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                self.hub.on_download(name, False, self.headers.get("Authorization"))
                return
            self.wfile.write(data[start:])
            with self.hub.lock:
                self.hub.downloads.append(name)
            self.hub.on_download(name, True, self.headers.get("Authorization"))
            return
        self._not_found()


class QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hung up is not an error of the fake."""


def serve(root: Path, host: str = "127.0.0.1", port: int = 0, **faults: Any) -> tuple[QuietServer, Hub]:
    """Start the fake Hub in a thread; returns (server, hub)."""
    hub = Hub(root, **faults)
    handler = type("BoundHandler", (Handler,), {"hub": hub})
    server = QuietServer((host, port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, hub


def write_safetensors(path: Path, tensors: dict[str, int]) -> None:
    """A valid safetensors file: an 8-byte header length, a JSON header, then the data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, count in tensors.items():
        header[name] = {"dtype": "U8", "shape": [count], "data_offsets": [offset, offset + count]}
        offset += count
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(range(256)) * (offset // 256) + bytes(offset % 256))


def make_checkpoint(repo: Path, shards: int, *, extra_dirs: tuple[str, ...] = ("original", "metal")) -> list[str]:
    """A tiny checkpoint with the published layout: root shards, their index, config, and unused folders."""
    repo.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i:05d}-of-{shards - 1:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, name in enumerate(names):
        write_safetensors(repo / name, {f"layer{i}.weight": 512 + i})
        weight_map[f"layer{i}.weight"] = name
    (repo / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (repo / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    (repo / "tokenizer.json").write_text("{}")
    for d in extra_dirs:
        (repo / d).mkdir(exist_ok=True)
        write_safetensors(repo / d / "model.safetensors", {"unused": 4096})
    return names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", required=True, type=Path)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--fail-file")
    p.add_argument("--fail-times", type=int, default=0)
    p.add_argument("--ready-file", type=Path, help="write the listening port here once serving")
    args = p.parse_args()
    server, _ = serve(args.root, args.host, args.port, fail_file=args.fail_file, fail_times=args.fail_times)
    if args.ready_file:
        args.ready_file.write_text(str(server.server_address[1]))
    threading.Event().wait()


if __name__ == "__main__":
    main()
