"""Settings of the guest's fakes, passed by the harness through QEMU's fw_cfg (JSON)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

FW_CFG = Path("/sys/firmware/qemu_fw_cfg/by_name/opt/gptoss/fakes/raw")
# A fault injected while the guest runs (the harness writes it over SSH), over the boot's settings.
OVERRIDES = Path("/run/fakes")
# FAKES_RECORDS: a loopback test running a guest fake outside the guest keeps its records apart.
RECORDS = Path(os.environ.get("FAKES_RECORDS", "/var/lib/fakes"))


def settings(section: str) -> dict[str, Any]:
    """The harness's settings for one fake, or {} when none were given."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        out = dict(json.loads(FW_CFG.read_text()).get(section, {}))
    with contextlib.suppress(OSError, ValueError):
        out |= json.loads((OVERRIDES / f"{section}.json").read_text())
    return out


def uptime() -> float:
    """Seconds since this boot."""
    return float(Path("/proc/uptime").read_text().split()[0])


def boot_id() -> str:
    """This boot's id (the records say which boot they came from)."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def record(name: str, doc: dict[str, Any]) -> None:
    """Append one JSON line to a record file the harness reads."""
    RECORDS.mkdir(parents=True, exist_ok=True)
    line = json.dumps(doc | {"boot_id": boot_id(), "uptime": uptime()})
    with (RECORDS / name).open("a") as f:
        f.write(line + "\n")
        f.flush()
