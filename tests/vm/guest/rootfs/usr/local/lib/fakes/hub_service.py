"""The fake Hub of the test guest: /srv/hub on 127.0.0.1:8900, faults from fw_cfg section "hub".

Every download is recorded in /var/lib/fakes/hub.jsonl (file, complete or cut half-way, and
whether it carried the token the harness put in the guest's Secrets Manager).
"""

import sys
import threading
from pathlib import Path

sys.path.insert(0, "/usr/local/lib/fakes")
import fakectl
import hub

s = fakectl.settings("hub")
server, state = hub.serve(
    Path("/srv/hub"),
    "127.0.0.1",
    8900,
    fail_file=s.get("fail_file"),
    fail_times=int(s.get("fail_times", 0)),
    on_download=lambda name, complete, auth: fakectl.record(
        "hub.jsonl", {"file": name, "complete": complete, "token": auth == f"Bearer {fakectl.settings('secrets').get('hf_token')}"}
    ),
)
threading.Event().wait()
