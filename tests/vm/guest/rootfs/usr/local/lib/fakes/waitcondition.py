"""Stand-in for CloudFormation's wait condition handle (a presigned S3 URL) on 127.0.0.1:9901.

Every PUT is recorded in /var/lib/fakes/signals.jsonl: the path, the Content-Type the node
sent (the real URL is signed without one) and the JSON body.
"""

import http.server
import json
import sys

sys.path.insert(0, "/usr/local/lib/fakes")
import fakectl


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {"unparsed": body.decode(errors="replace")}
        fakectl.record("signals.jsonl", {"path": self.path, "content_type": self.headers.get("Content-Type"), "body": doc})
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


http.server.ThreadingHTTPServer(("127.0.0.1", 9901), Handler).serve_forever()
