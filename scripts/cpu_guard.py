"""Run a command, then print the CPU time it and every process it waited for took; fail past a ceiling.

`make test` runs pytest through it: the suite's cost is printed at every run, and a suite that grows
past --fail-above fails loudly instead of slowing every stop a little more (docs/verification.md
'How long it takes' keeps the profile).

    python scripts/cpu_guard.py --label "make test" --target 600 --fail-above 1300 -- CMD ...
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    """Run CMD; print one line of its CPU time; exit with its code, or 1 when it passed but took more than --fail-above."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="the command")
    p.add_argument("--target", type=float, required=True, help="the CPU seconds the project keeps to (said when over)")
    p.add_argument("--fail-above", type=float, required=True, help="CPU seconds past which a passing run fails")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --")
    code = subprocess.run(command).returncode
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    line = f"{args.label}: {cpu:,.1f} s of CPU ({usage.ru_utime:,.1f} s user + {usage.ru_stime:,.1f} s system)"
    if cpu > args.fail_above:
        print(f"{line}: FAILED, over the {args.fail_above:,g} s ceiling (the target is {args.target:,g} s); "
              "share a synthesis or bound a load by a count instead of adding one", flush=True)  # fmt: skip
        return code or 1
    if cpu > args.target:
        print(f"{line}: over the {args.target:,g} s target, under the {args.fail_above:,g} s ceiling", flush=True)
    else:
        print(f"{line}: within the {args.target:,g} s target", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
