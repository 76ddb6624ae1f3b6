"""``tinker-sr usage``: what a store's sessions used (`tinker_sr.engine.usage`), totalled per
session, base model or hour, read from the store directly (no engine, no server; a server
may be running on the same store).

The same numbers as `AdminClient.get_billing_usage` (which answers per hour, at most 14 days
at a time), for a terminal: the embedded engine's users have no ``tinker billing`` to run.
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tinker_sr.engine import usage
from tinker_sr.user_errors import EngineUserError

COLUMNS = (
    (usage.TRAINING, "trained"),
    (usage.PREFILL, "prefilled"),
    (usage.PREFILL_CACHED, "prefill cached"),
    (usage.SAMPLE, "sampled"),
    (usage.CHECKPOINT, "checkpoints"),
)
GROUPS = ("session", "model", "hour")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=None,
        help="state directory (default $TINKER_SR_STORE or ~/.cache/tinker_sr)",
    )
    window = p.add_mutually_exclusive_group()
    window.add_argument(
        "--hours",
        type=float,
        default=24.0,
        help="the last this many hours, counted in whole UTC hours (default 24)",
    )
    window.add_argument(
        "--since",
        default=None,
        metavar="TIME",
        help="from this RFC 3339 time on (rounded down to its UTC hour) instead of --hours",
    )
    p.add_argument("--by", choices=GROUPS, default="session", help="one row per (default session)")
    p.add_argument(
        "--rate-card",
        default=None,
        metavar="FILE",
        help="JSON prices (docs/server.md, 'Usage and cost'; default $TINKER_SR_RATE_CARD): "
        "adds a cost column",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _window(args: argparse.Namespace, now: float) -> tuple[int, int]:
    end = usage.hour_bucket(now) + usage.HOUR_S  # the current hour, whole
    if args.since is not None:
        start = usage.hour_bucket(usage.utc_time(args.since, "--since").timestamp())
        return min(max(start, 0), end), end  # a future --since: an empty window
    if not (args.hours > 0 and math.isfinite(args.hours)):
        raise EngineUserError(f"--hours must be positive and finite, got {args.hours}")
    # Whole UTC hours, the current one included: 0.5 is the current hour, 1.5 two hours; a
    # huge number is everything since 1970 (no usage is older).
    hours = min(math.ceil(args.hours), end // usage.HOUR_S)
    return end - hours * usage.HOUR_S, end


def _key(row: usage.UsageRow, by: str) -> str:
    if by == "hour":
        return datetime.fromtimestamp(row.bucket_start, UTC).strftime("%Y-%m-%d %H:00")
    return row.session_id if by == "session" else row.base_model


def summarize(
    rows: Sequence[usage.UsageRow], by: str, rates: usage.RateCard | None
) -> list[dict[str, Any]]:
    """One dict per group (sorted by its key), with each kind's total and, with ``rates``,
    the cost of the priced kinds (``None`` when nothing in the group was priced)."""
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:
        g = groups.setdefault(_key(r, by), {by: _key(r, by), **{k: 0 for k, _ in COLUMNS}})
        g[r.kind] += r.quantity
        priced = rates.token_cost(r.base_model, r.kind, r.quantity) if rates else None
        if priced is not None:
            g["cost_usd"] = g.get("cost_usd", 0.0) + priced[1]
    out = [groups[k] for k in sorted(groups)]
    if rates is not None:
        for g in out:
            g.setdefault("cost_usd", None)
    return out


def _table(groups: list[dict[str, Any]], by: str, priced: bool) -> str:
    header = [by, *(title for _, title in COLUMNS)] + (["cost (USD)"] if priced else [])
    total = {k: sum(g[k] for g in groups) for k, _ in COLUMNS}
    body = [[str(g[by]), *(f"{g[k]:,}" for k, _ in COLUMNS)] for g in groups]
    body.append(["total", *(f"{total[k]:,}" for k, _ in COLUMNS)])
    if priced:
        costs = [g["cost_usd"] for g in groups]
        priced_costs = [c for c in costs if c is not None]
        total_cost = math.fsum(priced_costs) if priced_costs else None  # nothing priced: "-"
        for line, cost in zip(body, [*costs, total_cost], strict=True):
            line.append("-" if cost is None else f"{cost:.6f}")
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )

    return "\n".join([fmt(header), *(fmt(line) for line in body)])


def main(args: argparse.Namespace) -> int:
    # no torch: a quick report
    from tinker_sr.engine.store import Store, StoreDamagedError, default_store_dir

    store_dir = Path(args.store).expanduser() if args.store else default_store_dir()
    db = store_dir / "engine.sqlite"
    try:
        rates = usage.RateCard.resolve(args.rate_card)
        start, end = _window(args, time.time())
        if not db.is_file():
            raise EngineUserError(
                f"no engine store at {store_dir} (no engine.sqlite): pass --store, the directory "
                "a run or `tinker-sr serve --store` used"
            )
    except EngineUserError as e:
        print(f"tinker-sr usage: {e}", file=sys.stderr)
        return 2
    try:
        store = Store.for_reading(db)
        try:
            newest = store.newest_usage_bucket()
            if newest is not None and newest >= end:
                # Recorded while the wall clock ran ahead (since stepped back): the window
                # reaches it, or that usage would be hidden until the clock caught up.
                end = newest + usage.HOUR_S
            groups = summarize(store.usage_rows(start, end), args.by, rates)
            storage = usage.storage_response(store.live_checkpoint_sizes(time.time()), rates)
        finally:
            store.close()
    except (StoreDamagedError, sqlite3.DatabaseError) as e:
        print(f"tinker-sr usage: {e}", file=sys.stderr)
        return 2
    since, until = (datetime.fromtimestamp(t, UTC).isoformat() for t in (start, end))
    monthly = [i.estimated_monthly_cost_usd for i in storage.data]
    priced = [c for c in monthly if c is not None]
    stored: dict[str, Any] = {
        "checkpoints": sum(i.checkpoint_count for i in storage.data),
        "bytes": sum(i.size_bytes for i in storage.data),
        "monthly_cost_usd": sum(priced) if priced and len(priced) == len(monthly) else None,
    }
    if args.json:
        print(
            json.dumps(
                {"starting_on": since, "ending_before": until, "rows": groups, "storage": stored},
                indent=2,
            )
        )
        return 0
    print(f"usage in {store_dir}, {since} to {until} (tokens; UTC hours)")
    print(_table(groups, args.by, rates is not None) if groups else "nothing used in this window")
    cost = stored["monthly_cost_usd"]
    per_month = "" if cost is None else f" ({cost:.6f} USD a month)"
    print(
        f"stored now: checkpoints {stored['checkpoints']}, {stored['bytes'] / 1e6:,.1f} MB{per_month}"
    )
    return 0
