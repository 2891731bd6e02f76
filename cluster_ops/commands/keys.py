"""`gptoss keys`: the cluster's API keys (list, create, rotate, revoke) in its Secrets Manager secret."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from typing import Any

from cluster_ops import common
from cluster_ops.api_keys import Keys, KeysError, secret_id


def run(args: argparse.Namespace) -> int:
    cfg = common.load(args)
    common.announce(cfg)
    try:
        sid = secret_id(cfg)
    except KeysError as e:
        raise common.CliError(f"{e}. Nothing to manage.") from None
    keys = Keys(common.session(cfg).client("secretsmanager"), sid)
    now = dt.datetime.now(dt.UTC)
    refresh = cfg.serving.endpoint.keys_refresh_s
    try:
        if args.action == "list":
            rows = keys.rows(now)
            t = common.table(title=f"API keys of {cfg.cluster_name} in {sid} (no key is ever shown again after create)")
            for col in ("name", "created", "valid until", "requests/s", "concurrent"):
                t.add_column(col)
            e = cfg.serving.endpoint
            for r in rows:
                t.add_row(r.name, r.created, r.expires or "revoked", str(r.requests_per_s or f"{e.key_requests_per_s} (default)"),
                          str(r.concurrency or f"{e.key_concurrency} (default)"))  # fmt: skip
            common.console(args).print(t)
            if not rows:
                print("no valid key: every /v1/ request is refused 401. Create one: gptoss keys create NAME", file=sys.stderr)
            return 0
        if args.action == "create":
            key = keys.create(args.name, now, requests_per_s=args.requests_per_s, concurrency=args.concurrency)
            print(f"created key {args.name} in {sid}: every router takes it within {refresh} s. It is shown this once:", file=sys.stderr)
            print(key)
            return 0
        if args.action == "rotate":
            key, ends = keys.rotate(args.name, now, grace_s=args.grace)
            print(f"rotated {args.name} in {sid}: the new key is valid within {refresh} s; the old one until {ends} "
                  f"(give the client the new one before then). The new key, shown this once:", file=sys.stderr)  # fmt: skip
            print(key)
            return 0
        # revoke: destructive, asked
        if not args.yes:
            if not sys.stdin.isatty():
                raise common.CliError(f"refusing to revoke {args.name} without confirmation (no terminal). Fix: run it in a terminal, or pass --yes.", 1)
            answer = input(f"clients using {args.name} are refused within {refresh} s; type the key name ({args.name}) to revoke it: ").strip()
            if answer != args.name:
                raise common.CliError(f"not confirmed ({answer!r} is not {args.name}): nothing was revoked.", 1)
        gone = keys.revoke(args.name, now)
        print(f"revoked {gone} key{'s' * (gone != 1)} named {args.name} in {sid}: every router refuses {'them' if gone != 1 else 'it'} "
              f"within {refresh} s", file=sys.stderr)  # fmt: skip
        return 0
    except KeysError as e:
        raise common.CliError(str(e), 1) from None


def register(sub: Any) -> None:
    """Add the command to the parser."""
    k = sub.add_parser("keys", help="the endpoint's API keys: list, create, rotate, revoke")
    actions = k.add_subparsers(dest="action", required=True, help="what to do with the keys")
    listing = actions.add_parser("list", help="names, dates and limits (never a key)")
    create = actions.add_parser("create", help="a new key for a client, printed once")
    create.add_argument("name", help="the client's name (1-64 of A-Z a-z 0-9 . _ -); it names the key in logs and metrics")
    create.add_argument("--requests-per-s", type=int, default=None, metavar="N", help="this key's own rate limit per router node")
    create.add_argument("--concurrency", type=int, default=None, metavar="N", help="this key's own concurrent requests per router node")
    rotate = actions.add_parser("rotate", help="a new key for a name; the old one stays valid for --grace seconds")
    rotate.add_argument("name")
    rotate.add_argument("--grace", type=int, default=3600, metavar="S", help="how long the old key stays valid (default 3600)")
    revoke = actions.add_parser("revoke", help="every key of a name, refused within a minute (asks first)")
    revoke.add_argument("name")
    revoke.add_argument("--yes", action="store_true", help="revoke without asking")
    for sp in (listing, create, rotate, revoke):
        common.add_target_arguments(sp)
        common.add_width_arguments(sp)
        sp.set_defaults(func=run)
