"""A stand-in for the EC2 instance metadata service (IMDSv2) inside the test guest.

Listens on 169.254.169.254:80 (a dummy interface holds the address). Settings (fw_cfg
section "imds"): local_ipv4, instance_id, fail_s (answer 503 for this many seconds from the
first request of the boot, to model an IMDS outage at first boot).
"""

from __future__ import annotations

import http.server
import json
import secrets
import sys
import time

sys.path.insert(0, "/usr/local/lib/fakes")
import fakectl

TOKENS: set[str] = set()
FIRST: float | None = None  # uptime of the boot's first request
ROLE = "gptoss-node-role"


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def _reply(self, status: int, body: str = "") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _failing(self) -> bool:
        global FIRST
        FIRST = FIRST if FIRST is not None else fakectl.uptime()
        failing = fakectl.uptime() - FIRST < float(fakectl.settings("imds").get("fail_s", 0))
        fakectl.record("imds.jsonl", {"method": self.command, "path": self.path, "failed": failing})
        return failing

    def do_PUT(self) -> None:
        if self._failing():
            return self._reply(503, "Service Unavailable")
        if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._reply(400, "Bad Request")
        token = secrets.token_hex(16)
        TOKENS.add(token)
        self._reply(200, token)

    def do_GET(self) -> None:
        if self._failing():
            return self._reply(503, "Service Unavailable")
        if self.headers.get("X-aws-ec2-metadata-token") not in TOKENS:
            return self._reply(401, "Unauthorized")
        s = fakectl.settings("imds")
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 6 * 3600))
        values = {
            "/latest/meta-data/local-ipv4": s.get("local_ipv4", ""),
            "/latest/meta-data/instance-id": s.get("instance_id", ""),
            "/latest/meta-data/placement/region": s.get("region", "us-east-2"),
            # The instance role's credentials (the local S3 accepts any).
            "/latest/meta-data/iam/security-credentials/": ROLE,
            f"/latest/meta-data/iam/security-credentials/{ROLE}": json.dumps(
                {"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": "testing", "SecretAccessKey": "testing",
                 "Token": "testing", "Expiration": expires, "LastUpdated": expires}
            ),
        }
        if self.path not in values:
            return self._reply(404, "Not Found")
        self._reply(200, values[self.path])


if __name__ == "__main__":
    http.server.ThreadingHTTPServer(("169.254.169.254", 80), Handler).serve_forever()
