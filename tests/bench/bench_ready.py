"""Time to ready, measured: the default layout's two nodes booted in VMs, from kernel start to a serving proxy.

`make bench-ready` (root, QEMU; the guest image is the VM tests' cached one). The fake servers
"compile" for C seconds the first time a role runs on a node (blank compile cache) and "load"
for L seconds; every other part is the real boot: cloud-init, systemd, the array, staging from
the local Hub, the node check, the units in the project's order. The script prints, in seconds
since each guest's kernel started, when the checkpoint was staged (the first server's start),
when the servers answered, when the proxy served and when the deploy gate was signalled, and
compares the proxy's time with

- the floor: staging done + C + L (one compile and one load, nothing else),
- the tested order's floor: staging done + C + 2L (replicas 1..N load the graph replica 0
  compiled, so they start when it answers: reference 000's start-order rule),
- the tutorial's one-at-a-time order: staging done + C + N*L.

The two guests boot together; their clocks start within a second of each other.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.vm import image as vm_image
from tests.vm.cluster import VmCluster
from tests.vm.machine import accelerator


def records(cluster: VmCluster, node: str, name: str, event: str | None = None) -> list[dict[str, Any]]:
    out = cluster.this_boot(node, cluster.vms[node].records(name))
    return [r for r in out if event is None or r.get("event") == event]


def first(rs: list[dict[str, Any]], what: str) -> float:
    if not rs:
        raise SystemExit(f"bench-ready: no record of {what}")
    return float(rs[0]["uptime"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-s", type=float, default=120, help="C: the fake servers' compile time (default 120)")
    p.add_argument("--load-s", type=float, default=30, help="L: the fake servers' load time (default 30)")
    args = p.parse_args()
    c, load = args.compile_s, args.load_s
    if os.geteuid() != 0:
        print("bench-ready: needs root (mmdebstrap --mode=root builds the guest image)", file=sys.stderr)
        return 2
    missing = vm_image.missing_tools()
    if missing:
        print(f"bench-ready: needs these Debian packages: {', '.join(missing)} (`make test-vm` installs them)", file=sys.stderr)
        return 2
    img = vm_image.build()
    accel = accelerator(img)
    if accel is None:
        print("bench-ready: QEMU can start the guest kernel with neither KVM nor TCG on this machine", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gptoss-bench-ready-") as tmp:
        cluster = VmCluster(Path(tmp), img, accel)
        try:
            cluster.deploy({})
            cluster.launch({"vllm": {"compile_s": c, "load_s": load}})
            cluster.wait_ready(3600)
            cluster.vms["prefill-0"].wait_until("test -s /var/lib/fakes/signals.jsonl", 300, "the deploy gate's signal")
            prefill = sorted(
                int(s.argv[s.argv.index("--port") + 1])
                for s in cluster.renders["prefill-0"].services
                if s.unit.startswith("gptoss-prefill@")
            )
            n = len(prefill)
            p_start = first(records(cluster, "prefill-0", f"vllm-{prefill[0]}.jsonl", "start"), "replica 0's start")
            p_ready0 = first(records(cluster, "prefill-0", f"vllm-{prefill[0]}.jsonl", "ready"), "replica 0's readiness")
            p_ready = max(first(records(cluster, "prefill-0", f"vllm-{port}.jsonl", "ready"), f"port {port}") for port in prefill)
            d_start = first(records(cluster, "decode-0", "vllm-8200.jsonl", "start"), "the decode server's start")
            d_ready = first(records(cluster, "decode-0", "vllm-8200.jsonl", "ready"), "the decode server's readiness")
            proxy = first(records(cluster, "prefill-0", "proxy.jsonl", "start"), "the proxy's start")
            gate = first(records(cluster, "prefill-0", "signals.jsonl"), "the deploy gate's signal")
        finally:
            cluster.stop()

    staged = max(p_start, d_start)
    floors = {
        "floor: staged + C + L": staged + c + load,
        "tested order: staged + C + 2L": staged + c + 2 * load,
        f"tutorial, one at a time: staged + C + {n}L": staged + c + n * load,
    }
    print(f"time to ready, default layout ({n} prefill replicas + proxy on prefill-0, decode on decode-0), "
          f"{accel.upper()}, C = {c:.0f} s, L = {load:.0f} s")  # fmt: skip
    print("seconds since the guest's kernel started       prefill-0  decode-0")
    print(f"checkpoint staged, first server starts        {p_start:9.1f} {d_start:9.1f}")
    print(f"first server answers (compiled and loaded)    {p_ready0:9.1f} {d_ready:9.1f}")
    print(f"every server answers                          {p_ready:9.1f} {d_ready:9.1f}")
    print(f"proxy serving                                 {proxy:9.1f}")
    print(f"deploy gate signalled (after a completion)    {gate:9.1f}")
    for name, value in floors.items():
        print(f"{name:<46}{value:9.1f}   measured / this = {proxy / value:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
