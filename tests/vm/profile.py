"""Where a VM scenario's time goes: the harness's own waits and commands, by kind, per scenario.

Every wait and guest command of the harness is timed (machine.py and cluster.py call `span`);
`pytest_runtest_*` in conftest.py says which scenario is running; at the end the table is printed
and written to vm-profile.json in the session's directory (docs/verification.md quotes it). The
kinds: `boot` (power-on to the harness's SSH login), `cloud-init` (to the end of cloud-init and
systemd's boot), `ready` (until every unit of the plan runs and answers: staging, the fake compile,
the servers' start), `wait` (the scenario's other waits on a guest condition), `command` (guest
commands run by the scenario itself), `shutdown` (reboots and power-offs), and `other` (the rest:
the host's own work, moto, assertions).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from threading import Lock, local

KINDS = ("boot", "cloud-init", "ready", "wait", "command", "shutdown")
_lock = Lock()
_nested = local()
current = "(setup)"
seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
wall: dict[str, float] = {}
# The harness's guest commands by what they run (their first words): seconds and count, per scenario.
commands: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
# Guest CPU by unit (systemd's cgroups, cpu.stat usage_usec), read at each scenario's end: what each scenario
# cost each guest, per unit since the previous reading of the same boot (the guest's whole first, "(guest)").
guest_cpu: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
_last_reading: dict[str, tuple[str, dict[str, float]]] = {}
# One guest command: its boot id, then each cgroup's CPU seconds (the guest total, the slices, every unit).
CPU_READ = (
    "cat /proc/sys/kernel/random/boot_id; cd /sys/fs/cgroup && "
    "awk '$1 == \"usage_usec\" {f = FILENAME; sub(\"/?cpu.stat$\", \"\", f); print (f == \"\" ? \"cpu.stat\" : f), $2}' "
    "cpu.stat */cpu.stat system.slice/*/cpu.stat system.slice/*/*/cpu.stat 2>/dev/null; true"
)


def command(text: str, seconds_taken: float) -> None:
    """Count one guest command of the running scenario under its first 48 characters."""
    key = " ".join(text.split())[:48]
    with _lock:
        entry = commands[current][key]
        entry[0] += seconds_taken
        entry[1] += 1


def record_guest_cpu(scenario: str, node: str, text: str) -> None:
    """Keep one guest's reading (CPU_READ's output) for the scenario: the seconds since the last reading of the same boot."""
    lines = text.strip().splitlines()
    if not lines:
        return
    boot, now = lines[0], {}
    for line in lines[1:]:
        name, _, usec = line.rpartition(" ")
        if usec.isdigit():
            now["(guest)" if name == "cpu.stat" else name.replace("system.slice/", "")] = int(usec) / 1e6
    before = _last_reading.get(node)
    base = before[1] if before and before[0] == boot else {}
    guest_cpu[scenario][node] = {k: round(v - base.get(k, 0.0), 1) for k, v in now.items() if v - base.get(k, 0.0) >= 0.5}
    _last_reading[node] = (boot, now)


@contextmanager
def span(kind: str) -> Iterator[None]:
    """Time a harness step as `kind` for the running scenario (the outermost span counts: a wait's
    own polls are not counted again as commands). Steps that run in parallel (two VMs booting at
    once) each count: a kind's seconds can exceed the scenario's wall time."""
    outer = getattr(_nested, "depth", 0) == 0
    _nested.depth = getattr(_nested, "depth", 0) + 1
    started = time.monotonic()
    try:
        yield
    finally:
        _nested.depth -= 1
        if outer:
            with _lock:
                seconds[current][kind] += time.monotonic() - started
                counts[current][kind] += 1


def table() -> list[dict[str, object]]:
    """One row per scenario: its wall time, and the seconds and counts of each kind."""
    rows = []
    for test, total in wall.items():
        row: dict[str, object] = {"scenario": test, "wall_s": round(total, 1)}
        for kind in KINDS:
            row[f"{kind}_s"] = round(seconds[test].get(kind, 0.0), 1)
            row[f"{kind}_n"] = counts[test].get(kind, 0)
        row["guest_cpu_s"] = guest_cpu.get(test, {})
        row["commands"] = {k: [round(v[0], 1), v[1]] for k, v in sorted(commands.get(test, {}).items(), key=lambda kv: -kv[1][0])}
        rows.append(row)
    return rows


def write(path: Path) -> str:
    """Write the table as JSON; return it as text for the terminal."""
    rows = table()
    path.write_text(json.dumps(rows, indent=1) + "\n")
    head = f"{'scenario':<60} {'wall':>6} " + " ".join(f"{k:>10}" for k in KINDS)
    lines = [head]
    for r in rows:
        cells = " ".join(f"{r[f'{k}_s']:>6.0f}s/{r[f'{k}_n']:<2}" for k in KINDS)
        lines.append(f"{str(r['scenario'])[:60]:<60} {r['wall_s']:>5.0f}s {cells}")
        for node, units in sorted(guest_cpu.get(str(r["scenario"]), {}).items()):
            total = units.get("(guest)", 0.0)
            top = sorted(((v, k.rsplit("/", 1)[-1]) for k, v in units.items() if k.endswith((".service", ".scope")) or k == "user.slice"), reverse=True)[:8]
            lines.append(f"    {node}: guest CPU {total:.0f} s; " + ", ".join(f"{k} {v:.0f}" for v, k in top))
        slow = sorted(commands.get(str(r["scenario"]), {}).items(), key=lambda kv: -kv[1][0])[:5]
        if slow:
            lines.append("    harness commands: " + "; ".join(f"{k!r} {v[0]:.0f}s/{v[1]}" for k, v in slow))
    return "\n".join(lines)
