"""The VM cluster's AWS: moto's server, with CloudFormation's SignalResource, which moto lacks.

The harness plays CloudFormation's rolling update with surge around the nodes (tests/vm/cluster.py):
it launches a replacement beside the instance it replaces and goes on only when the replacement
signals its own group. Here that signal is accepted, as CloudFormation accepts it while such an
update waits for it, and recorded (one JSON line per call, with the time it came) in the file
GPTOSS_VM_SIGNALS names, which the harness reads. Tests only: nothing the project ships runs it.

    python -m tests.vm.moto_signals -H 127.0.0.1 -p 0   (moto_server's own arguments)
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

NS = "http://cloudformation.amazonaws.com/doc/2010-05-15/"


def _signal_resource(self: Any) -> str:
    call = {k: self._get_param(k) for k in ("StackName", "LogicalResourceId", "UniqueId", "Status")}
    with open(os.environ["GPTOSS_VM_SIGNALS"], "a") as f:
        f.write(json.dumps(call | {"time": time.time()}) + "\n")
    return f'<SignalResourceResponse xmlns="{NS}"><ResponseMetadata><RequestId>vm</RequestId></ResponseMetadata></SignalResourceResponse>'


if __name__ == "__main__":
    from moto.cloudformation.responses import CloudFormationResponse
    from moto.server import main

    CloudFormationResponse.signal_resource = _signal_resource  # type: ignore[attr-defined]
    main(sys.argv[1:])
