"""The Trainium instance's devices, as the harness says the instance has them (fw_cfg "devices").

{"neuron": N, "efa": M}: N character devices /dev/neuron0..N-1 (the node check counts them);
the EFA count is read by the fake fi_info. The harness passes the instance table's counts, or
fewer to play a node that lost a device.
"""

import os
import stat
import sys

sys.path.insert(0, "/usr/local/lib/fakes")
import fakectl

for i in range(int(fakectl.settings("devices").get("neuron", 0))):
    path = f"/dev/neuron{i}"
    if not os.path.exists(path):
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
