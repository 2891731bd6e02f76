"""`gptoss blocks`: the Capacity Blocks for ML that fit the planned fleet, the extensions of the ones it
runs in, and their purchase (only with an offering's id and a confirmation)."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from typing import Any

from cluster_ops import common

HOURS_HELP = "the block's length in hours (EC2 sells 1 to 14 days in 24-hour steps, then 7-day steps up to 182 days)"


def _date(text: str) -> dt.datetime:
    try:
        d = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date (YYYY-MM-DD or YYYY-MM-DDTHH:MM, UTC)") from None
    return d if d.tzinfo else d.replace(tzinfo=dt.UTC)


def _confirm(what: str, token: str, yes: bool) -> None:
    """Go on only with --yes or the token typed at a terminal."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise common.CliError(f"refusing to buy {what} without confirmation (no terminal). Fix: run it in a terminal, or pass --yes.", 1)
    answer = input(f"buying is not reversible: type the offering id ({token}) to buy {what}: ").strip()
    if answer != token:
        raise common.CliError(f"not confirmed ({answer!r} is not {token}): nothing was bought.", 1)


def run(args: argparse.Namespace) -> int:
    """List offerings or extensions, or buy one."""
    from cluster_ops import blocks

    cfg = common.load(args)
    common.announce(cfg)
    ec2 = common.session(cfg).client("ec2")
    if args.purchase_extension:
        ids = blocks.blocks_in_use(cfg)
        reservation = args.reservation or (ids[0] if len(ids) == 1 else None)
        if reservation is None:
            raise common.CliError(f"--purchase-extension needs the block it extends: --reservation cr-... (this cluster's: {', '.join(ids) or 'none'}).")
        _confirm(f"the extension {args.purchase_extension} of {reservation}", args.purchase_extension, args.yes)
        done = blocks.purchase_extension(ec2, args.purchase_extension, reservation)
        for e in done.get("CapacityBlockExtensions", []):
            print(f"extended {e['CapacityReservationId']}: {e.get('CapacityBlockExtensionStatus', '?')}, "
                  f"new end {e['CapacityBlockExtensionEndDate']:%Y-%m-%d %H:%M} UTC; `gptoss status` shows it")  # fmt: skip
        return 0
    if args.purchase:
        _confirm(f"the Capacity Block offering {args.purchase}", args.purchase, args.yes)
        done = blocks.purchase(ec2, args.purchase, cfg.cluster_name)
        for b in done.get("CapacityBlocks", []) or []:
            print(f"bought {b.get('CapacityBlockId', '?')} in {b.get('AvailabilityZone', '?')}: {b.get('StartDate'):%Y-%m-%d %H:%M} to "
                  f"{b.get('EndDate'):%Y-%m-%d %H:%M} UTC, reservations {', '.join(b.get('CapacityReservationIds', []))}")  # fmt: skip
        cr = done.get("CapacityReservation") or {}
        if cr.get("CapacityReservationId"):
            print(f"launch into it: -c capacity.type=capacity-block -c capacity.reservation_id={cr['CapacityReservationId']} "
                  "(or capacity.roles.<role>.reservation_id for one role)")  # fmt: skip
        return 0
    if args.extend:
        ids = blocks.blocks_in_use(cfg)
        if not ids:
            raise common.CliError("--extend extends the Capacity Blocks the cluster runs in; its spec names none "
                                  "(capacity.type=capacity-block with capacity.reservation_id or capacity.roles).")  # fmt: skip
        exts = [e for i in ids for e in blocks.extensions(ec2, i, hours=args.hours)]
        print(f"{len(exts)} extension offering(s) of {args.hours} h for {', '.join(ids)}")
        for e in exts:
            print(f"  {e.reservation_id}  {e.count} x {e.instance_type}  to {e.new_end:%Y-%m-%d %H:%M} UTC  {e.upfront_fee} {e.currency}  {e.offering_id}")
            print(f"    buy: gptoss blocks --purchase-extension {e.offering_id} --reservation {e.reservation_id}   (or {e.purchase_command(cfg.region)})")
        return 0
    found = 0
    for need in blocks.needs(cfg, whole=args.whole):
        rows = blocks.offerings(ec2, need, hours=args.hours, start_after=args.start_after, end_before=args.end_before)
        found += len(rows)
        print(f"{need.role}: {need.count} x {need.instance_type} for {args.hours} h: {len(rows)} offering(s)")
        for o in rows:
            az = "" if o.availability_zone == cfg.availability_zone else f" (not the cluster's {cfg.availability_zone}: set availability_zone)"
            print(f"  {o.start:%Y-%m-%d %H:%M} to {o.end:%Y-%m-%d %H:%M} UTC  {o.availability_zone}{az}  {o.upfront_fee} {o.currency} upfront  {o.offering_id}")
            print(f"    buy: gptoss blocks --purchase {o.offering_id}   (or {o.purchase_command(cfg.region)})")
    if not found:
        print("no offering fits: try another --hours, a later --start-after, --whole or another region")
    return 0


def register(sub: Any) -> None:
    """Add the command to the parser."""
    b = sub.add_parser("blocks", help="Capacity Blocks for ML that fit the fleet, extensions of the cluster's blocks, and their purchase")
    common.add_target_arguments(b)
    b.add_argument("--hours", type=int, default=24, help=HOURS_HELP + " (default 24)")
    b.add_argument("--whole", action="store_true", help="one block for the whole fleet (default: one per role)")
    b.add_argument("--start-after", type=_date, metavar="DATE", help="offerings that start after this (UTC)")
    b.add_argument("--end-before", type=_date, metavar="DATE", help="offerings that end before this (UTC)")
    b.add_argument("--extend", action="store_true", help="the extension offerings of the blocks the cluster runs in")
    b.add_argument("--purchase", metavar="OFFERING_ID", help="buy this Capacity Block offering (asks; --yes for automation)")
    b.add_argument("--purchase-extension", metavar="OFFERING_ID", help="buy this extension (asks; --yes for automation)")
    b.add_argument("--reservation", metavar="CR_ID", help="the block an extension extends (default: the cluster's one block)")
    b.add_argument("--yes", action="store_true", help="buy without asking")
    b.set_defaults(func=run)
