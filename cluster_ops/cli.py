"""gptoss: the operator's commands for a gpt-oss cluster on Trainium.

Every command acts on the cluster its parameters name (`-c KEY=VALUE`, `--config FILE`, or
`--stack NAME` of a stack deployed from this checkout) and says which in its first line
(stack, region, cluster tag). Commands that talk to AWS turn every AWS error into one line
and exit 2; invalid parameters exit 2 with the field, value, rule and fix.
"""

from __future__ import annotations

import argparse
import os
import sys

from cluster_ops import common
from cluster_ops.commands import COMMANDS
from clusterspec.errors import SpecError


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface: each command module adds its own subcommand."""
    p = argparse.ArgumentParser(prog="gptoss", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    # Each subcommand's --help starts with what it does (the line the command list shows).
    for sp in sub.choices.values():
        sp.description = sp.description or next(a.help for a in sub._choices_actions if a.dest == sp.prog.split()[-1])
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command: exit 0 done, 1 not done (checks failed, not ready, not confirmed), 2 cannot run."""
    # Throttled calls are retried with client-side rate limiting before an error reaches anyone.
    os.environ.setdefault("AWS_RETRY_MODE", "adaptive")
    # A local endpoint (AWS_ENDPOINT_URL) does not throttle: a failing one is said after 3 attempts, not a minute of them.
    os.environ.setdefault("AWS_MAX_ATTEMPTS", "3" if os.environ.get("AWS_ENDPOINT_URL") else "8")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if getattr(args, "passthrough", False):
            return int(args.func(args, [a for a in extra if a != "--"]))
        return int(args.func(args))
    except SpecError as e:
        print(f"invalid deployment parameters:\n{e}", file=sys.stderr)
        return 2
    except common.CliError as e:
        print(f"gptoss {args.command}: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (gptoss plan | head): stop quietly, as cat does; Python would
        # otherwise complain again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        from cluster_ops.awserrors import explain  # botocore's parsers: a tenth of a second that plan needs not pay

        line = explain(e, region=common.loaded_region() or os.environ.get("AWS_REGION", "the configured region"))
        if line:
            print(f"gptoss {args.command}: {line}", file=sys.stderr)
            return 2
        if os.environ.get("GPTOSS_DEBUG"):
            raise
        print(f"gptoss {args.command}: internal error: {type(e).__name__}: {e} (set GPTOSS_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
