"""``tinker-sr plot``: learning curves of your own runs, from their ``metrics.jsonl``.

Reads what ``tinker-sr demo --out DIR`` writes and what tinker-cookbook's ``ml_log`` writes
into a ``log_path``: one JSON object per line, usually with a ``step`` key, and metric keys
such as ``reward`` or ``env/all/reward/total``. Lines may carry different keys; values that
are not numbers (strings, dicts, null) are ignored, NaN and infinities are gaps. Several
runs overlay on the same axes, one colour per run.

`plot_curves` is also what ``tinker-sr demo`` draws its own PNG with. matplotlib is optional
(``pip install 'tinker-sr[plot]'``): without it the command prints a text summary per key
(first, last, min, max and a sparkline) instead of the PNG.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
DEFAULT_PNG = "curves.png"
INDEX = "index"  # --x index: the record's number in its file
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40
FALLBACK_KEYS = 4  # keys drawn when none is reward-, loss-, KL- or entropy-like
INSTALL_HINT = "pip install 'tinker-sr[plot]' (or matplotlib)"

Record = Mapping[str, Any]
XAxis = str | None | Mapping[str, str | None]
"""A numeric key, None for the record's number, or one of those per run name."""


class PlotInputError(ValueError):
    """A path, file or option the command cannot use; the message is one line naming it."""


class _NoMetricsYet(PlotInputError):
    """A metrics file with no complete record (empty, or its first line being written)."""


@dataclass(frozen=True)
class Panel:
    """One subplot: ``key`` per step, titled ``title`` (default the key), on a log scale or not."""

    key: str
    title: str = ""
    log: bool = False


@dataclass
class Run:
    name: str
    path: Path
    records: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)


# ---- values and series --------------------------------------------------------------------------


def number(value: Any) -> float | None:
    """``value`` as a float if it is a number (a bool is not), else None; NaN and the
    infinities (and integers too large for a float) are NaN: a gap in the curve."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        v = float(value)
    except OverflowError:
        return math.nan
    return v if math.isfinite(v) else math.nan


def fmt(v: float) -> str:
    return f"{v:.4g}"


def series(records: Sequence[Record], key: str, x: str | None) -> tuple[list[float], list[float]]:
    """(xs, ys) of ``key``: a point per record with a number for ``key`` and, unless ``x`` is
    None (the record's number), a finite number for ``x``."""
    xs: list[float] = []
    ys: list[float] = []
    for i, record in enumerate(records):
        y = number(record.get(key))
        if y is None:
            continue
        xv = float(i) if x is None else number(record.get(x))
        if xv is None or math.isnan(xv):
            continue
        xs.append(xv)
        ys.append(y)
    return xs, ys


def moving_average(ys: Sequence[float], n: int) -> list[float]:
    """Trailing mean over the last ``n`` points, NaN points left out (a window with none
    finite is NaN). ``n`` <= 1: ``ys`` unchanged."""
    if n <= 1:
        return list(ys)
    out = []
    partials: list[float] = []  # the window's finite points, summed exactly (`_add_exact`)
    count = 0
    for i, y in enumerate(ys):
        if not math.isnan(y):
            _add_exact(partials, y)
            count += 1
        if i >= n and not math.isnan(old := ys[i - n]):
            _add_exact(partials, -old)  # exact: an outlier leaves no residue
            count -= 1
        if not count:
            out.append(math.nan)
            partials.clear()
            continue
        total = math.fsum(partials)
        if not math.isfinite(total):  # overflow inside the partials: sum the window itself
            window = [v for v in ys[max(0, i - n + 1) : i + 1] if not math.isnan(v)]
            total = math.fsum(window)
        out.append(total / count)
    return out


def _add_exact(partials: list[float], x: float) -> None:
    """Add ``x`` to the exact sum held as non-overlapping ``partials`` (Shewchuk's algorithm,
    what `math.fsum` does inside): O(len(ys)) moving averages, exact as ``fsum`` of a window."""
    i = 0
    for y in partials:
        if abs(x) < abs(y):
            x, y = y, x
        hi = x + y
        lo = y - (hi - x)
        if lo:
            partials[i] = lo
            i += 1
        x = hi
    partials[i:] = [x]


def sparkline(ys: Sequence[float], width: int = SPARK_WIDTH) -> str:
    """``ys`` in at most ``width`` block characters (bucket means; a gap is a space)."""
    n = len(ys)
    buckets = [list(ys)] if n == 0 else []
    if n:
        cuts = [round(b * n / min(n, width)) for b in range(min(n, width) + 1)]
        buckets = [list(ys[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    means = []
    for bucket in buckets:
        finite = [y for y in bucket if not math.isnan(y)]
        means.append(math.fsum(finite) / len(finite) if finite else math.nan)
    finite = [m for m in means if not math.isnan(m)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    chars = []
    for m in means:
        if math.isnan(m):
            chars.append(" ")
        elif hi == lo:
            chars.append(SPARK[len(SPARK) // 2 - 1])
        else:
            chars.append(SPARK[min(len(SPARK) - 1, int((m - lo) / (hi - lo) * len(SPARK)))])
    return "".join(chars)


def key_stats(records: Iterable[Record]) -> dict[str, tuple[int, float]]:
    """Every key with a number in some record, in first-seen order: (finite values, last value)."""
    stats: dict[str, tuple[int, float]] = {}
    for record in records:
        for key, value in record.items():
            v = number(value)
            if v is not None:
                count = stats.get(key, (0, math.nan))[0]
                stats[key] = (count + (not math.isnan(v)), v)
    return stats


def all_numeric_keys(runs: Mapping[str, Sequence[Record]]) -> list[str]:
    seen: dict[str, None] = {}
    for records in runs.values():
        seen.update(dict.fromkeys(key_stats(records)))
    return list(seen)


# ---- which keys -------------------------------------------------------------------------------

# category -> how many keys of it the default pick draws
CATEGORIES = {"reward": 2, "loss": 2, "KL": 1, "entropy": 1}


def _category(key: str) -> tuple[str, int] | None:
    """(category, rank: lower is the likelier headline metric) of a key, or None."""
    low = key.lower()
    if low.startswith("time/"):  # tinker-cookbook's timings ("time/compute_group_rewards:total")
        return None
    tokens = [t for t in re.split(r"[^a-z0-9]+", low) if t]
    if "reward" in low:
        headline = low in ("reward", "env/all/reward/total")
        return "reward", 0 if headline else 1 if re.search(r"reward(/total|/mean)?$", low) else 2
    if "loss" in low or "nll" in tokens or low.endswith("nll"):
        return "loss", 0 if tokens and tokens[-1] in ("loss", "nll") else 1
    if "kl" in tokens:
        return "KL", 0
    if "entropy" in low:
        return "entropy", 0
    return None


def choose_keys(
    runs: Mapping[str, Sequence[Record]], x: str | None = "step"
) -> tuple[list[str], str]:
    """The default keys to draw, and a line saying how they were chosen: up to two reward-like
    and two loss-like keys, one KL and one entropy key; else the first few numeric keys."""
    keys = [k for k in all_numeric_keys(runs) if k not in ("step", x)]
    found: dict[str, list[tuple[int, int, str]]] = {c: [] for c in CATEGORIES}
    for order, key in enumerate(keys):
        if (cat := _category(key)) is not None:
            found[cat[0]].append((cat[1], order, key))
    picked = {c: [k for *_, k in sorted(found[c])[:n]] for c, n in CATEGORIES.items()}
    chosen = [k for ks in picked.values() for k in ks]
    if chosen:
        kinds = [c for c in CATEGORIES if picked[c]]
        return chosen, f"the default pick: {', '.join(kinds)} metrics"
    return keys[:FALLBACK_KEYS], (
        f"no reward, loss, KL or entropy key: the first {min(len(keys), FALLBACK_KEYS)} numeric keys"
    )


def _close_matches(key: str, candidates: Sequence[str]) -> list[str]:
    """Up to five keys like ``key``: containing it or contained in it, spelled alike, or
    sharing a word with it ("rewards" -> "reward", "env/all/reward/total")."""
    low = key.lower()
    near = [c for c in candidates if low in c.lower() or c.lower() in low]
    near += difflib.get_close_matches(key, candidates, n=5, cutoff=0.6)
    words = {w.rstrip("s") for w in re.split(r"[^a-z0-9]+", low) if len(w) > 2}
    near += [c for c in candidates if any(w in c.lower() for w in words)]
    return list(dict.fromkeys(near))[:5]


def unknown_key_error(key: str, what: str, runs: Mapping[str, Sequence[Record]]) -> PlotInputError:
    """The one-line error for ``key`` (given to ``what``) that no run has a number for."""
    numeric = all_numeric_keys(runs)
    present = any(key in r for records in runs.values() for r in records)
    head = (
        f"{what}: {key!r} has no numeric value in any run"
        if present
        else f"{what}: no run has the key {key!r}"
    )
    close = _close_matches(key, numeric)
    if close:
        return PlotInputError(f"{head}; close matches: {', '.join(close)}")
    return PlotInputError(f"{head}; --list shows the {len(numeric)} numeric keys there are")


def check_keys(asked: Sequence[str], runs: Mapping[str, Sequence[Record]]) -> list[str]:
    numeric = set(all_numeric_keys(runs))
    for key in asked:
        if key not in numeric:
            raise unknown_key_error(key, "--keys", runs)
    return list(asked)


# ---- drawing ----------------------------------------------------------------------------------


def _x_for(x: XAxis, name: str) -> str | None:
    return x.get(name, "step") if isinstance(x, Mapping) else x


def _x_label(x: XAxis, names: Iterable[str]) -> str:
    labels = dict.fromkeys(_x_for(x, n) or "record number" for n in names)
    return " or ".join(labels)


def _draw_panel(
    ax: Any, panel: Panel, runs: Mapping[str, Sequence[Record]], x: XAxis, smooth: int
) -> None:
    for i, (name, records) in enumerate(runs.items()):
        xs, ys = series(records, panel.key, _x_for(x, name))
        if not xs:
            continue
        if panel.log:
            ys = [y if y > 0 else math.nan for y in ys]
        color = f"C{i % 10}"  # a run keeps its colour in every panel, whatever it lacks
        marker = "o" if len(xs) == 1 else None
        if smooth > 1:
            ax.plot(xs, ys, color=color, lw=1.0, alpha=0.25, marker=marker)
            ys = moving_average(ys, smooth)
        ax.plot(xs, ys, color=color, lw=1.4, label=name, marker=marker, ms=4)
    if panel.log:
        ax.set_yscale("log")
    ax.set_title(panel.title or panel.key, fontsize=10)
    ax.grid(alpha=0.3)


def plot_curves(
    runs: Mapping[str, Sequence[Record]],
    path: str | Path,
    panels: Sequence[Panel | str] | None = None,
    *,
    title: str = "",
    x: XAxis = "step",
    smooth: int = 1,
) -> Path:
    """Draw each panel's key (default: `choose_keys`) against ``x`` for every run (name ->
    records), one colour per run, into the image ``path``; with ``smooth`` > 1 the trailing
    moving average over that many points, the raw curve faint behind it.

    Raises ImportError without matplotlib; OSError or ValueError if ``path`` cannot be
    written (ValueError: a format matplotlib does not know)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    with plt.rc_context({"text.parse_math": False}):  # a '$' in a key or run name is literal
        return _plot_curves(plt, Line2D, runs, path, panels, title=title, x=x, smooth=smooth)


def _plot_curves(
    plt: Any,
    Line2D: Any,
    runs: Mapping[str, Sequence[Record]],
    path: str | Path,
    panels: Sequence[Panel | str] | None,
    *,
    title: str,
    x: XAxis,
    smooth: int,
) -> Path:

    if panels is None:
        panels = choose_keys(runs, x if isinstance(x, str) else "step")[0]
    chosen = [p if isinstance(p, Panel) else Panel(p) for p in panels]
    ncols = 1 if len(chosen) == 1 else 2
    nrows = max(1, math.ceil(len(chosen) / ncols))
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(5 * ncols, 3.5 * nrows), sharex=True, squeeze=False
    )
    try:
        flat = list(axes.flat)
        for i, (ax, panel) in enumerate(zip(flat, chosen, strict=False)):
            _draw_panel(ax, panel, runs, x, smooth)
            if i + ncols >= len(chosen):  # nothing below it: it carries the x axis
                ax.set_xlabel(_x_label(x, runs))
                ax.tick_params(labelbottom=True)
        for ax in flat[len(chosen) :]:
            ax.remove()
        if len(runs) > 1 and flat:  # every run, even one the first panel lacks
            handles = [
                Line2D([], [], color=f"C{i % 10}", lw=1.4, label=name)
                for i, name in enumerate(runs)
            ]
            flat[0].legend(handles=handles, fontsize=8)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def text_summary(
    runs: Mapping[str, Sequence[Record]], keys: Sequence[str], x: XAxis, smooth: int = 1
) -> str:
    """Per key and run: values, first, last, min, max and a sparkline (of the moving average
    with ``smooth`` > 1): what the command prints without matplotlib."""
    width = max(len(name) for name in runs)
    lines = []
    for key in keys:
        lines.append(key)
        for name, records in runs.items():
            ys = series(records, key, _x_for(x, name))[1]
            finite = [y for y in ys if not math.isnan(y)]
            if not finite:
                lines.append(f"  {name:<{width}}  no values")
                continue
            lines.append(
                f"  {name:<{width}}  {len(finite)} values  first {fmt(finite[0])}  "
                f"last {fmt(finite[-1])}  min {fmt(min(finite))}  max {fmt(max(finite))}  "
                f"{sparkline(moving_average(ys, smooth))}"
            )
    return "\n".join(lines)


# ---- reading runs ---------------------------------------------------------------------------


def metrics_files(arg: str) -> list[Path]:
    """The metrics files ``arg`` names: itself, its ``metrics.jsonl``, or (a directory of
    runs) its subdirectories' ``metrics.jsonl``."""
    path = Path(arg).expanduser()
    if path.is_dir():
        if (path / METRICS_FILE).is_file():
            return [path / METRICS_FILE]
        try:
            children = sorted(p / METRICS_FILE for p in path.iterdir())
        except OSError as e:
            raise PlotInputError(f"{arg}: cannot list the directory ({e.strerror})") from None
        found = [p for p in children if p.is_file()]
        if found:
            return found
        raise PlotInputError(f"{arg}: no {METRICS_FILE} in this directory or its subdirectories")
    if path.is_file():
        return [path]
    if path.exists():
        raise PlotInputError(f"{arg}: not a file or directory")
    raise PlotInputError(f"{arg}: no such file or directory")


def _clip(text: str, limit: int = 60) -> str:
    text = text.strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")


def read_run(path: Path, name: str) -> Run:
    """The records of one metrics file. An unfinished last line (no newline: the run is still
    writing it) is skipped with a note; any other line that is not a JSON object is an error."""
    try:
        text = path.read_text(encoding="utf-8-sig", errors="replace")  # a BOM is not data
    except OSError as e:
        raise PlotInputError(f"{path}: cannot read ({e.strerror or e})") from None
    lines = text.split("\n")
    run = Run(name, path, [])
    for number_, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as e:  # + an integer too long, nesting too deep
            # no newline after it: the writer is mid-line
            if number_ == len(lines) and not isinstance(e, RecursionError):
                run.notes.append(
                    f"skipped the unfinished last line {number_} (still being written?)"
                )
                continue
            why = (
                e.msg
                if isinstance(e, json.JSONDecodeError)
                else "nested too deeply"
                if isinstance(e, RecursionError)
                else str(e)
            )
            raise PlotInputError(f"{path}:{number_}: not JSON ({why}): {_clip(line)}") from None
        if not isinstance(record, dict):
            raise PlotInputError(
                f"{path}:{number_}: a JSON {type(record).__name__}, not an object of metrics "
                f'like {{"step": 0, "reward": 0.5}}: {_clip(line)}'
            )
        run.records.append(record)
    if not run.records:
        what = "empty" if not text.strip() else "no complete line yet"
        raise _NoMetricsYet(f"{path}: {what}, no metrics to plot")
    return run


def _labels(paths: Sequence[Path]) -> list[str]:
    """Runs' labels: the directory's name for a ``metrics.jsonl``, else the file's stem; with
    as many parent folders as tell them apart (``a/run1``, ``b/run1``)."""
    stems = [p.parent if p.name == METRICS_FILE else p.with_suffix("") for p in paths]
    for depth in range(1, max(len(s.parts) for s in stems) + 1):
        labels = [Path(*s.parts[-depth:]).as_posix() for s in stems]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def load_runs(args: Sequence[str], skipped: list[str] | None = None) -> dict[str, Run]:
    """Every run the paths name, by label (labels made unique; a file named twice read once).
    Of several runs, one without metrics yet (empty, or its first line still being written:
    a run just started beside the others) is left out with a line in ``skipped``; an error
    only if no run has any."""
    paths = list(dict.fromkeys(p.resolve() for arg in args for p in metrics_files(arg)))
    labels = _labels(paths)
    runs: dict[str, Run] = {}
    first_error: PlotInputError | None = None
    for label, path in zip(labels, paths, strict=True):
        try:
            runs[label] = read_run(path, label)
        except _NoMetricsYet as e:
            if len(paths) == 1:
                raise
            first_error = first_error or e
            if skipped is not None:
                skipped.append(f"{label}: left out: {e}")
    if not runs:
        assert first_error is not None
        raise first_error
    return runs


def resolve_x(run: Run, x: str, runs: Mapping[str, Sequence[Record]]) -> str | None:
    """The x key of ``run`` for ``--x x``: None (the record number) for ``index``, or for
    ``step`` when the run has none; any other key the run lacks is an error."""
    if x == INDEX:
        return None
    if any(number(r.get(x)) is not None for r in run.records):
        return x
    if x == "step":
        run.notes.append("no numeric 'step' key: x is the record number")
        return None
    raise unknown_key_error(x, f"--x ({run.name})", runs)


def describe(run: Run, x: str | None) -> str:
    """The run's progress line: what was read, and from where."""
    if x is None:
        what = f"{len(run.records)} records"
    else:
        xs = [v for r in run.records if (v := number(r.get(x))) is not None and not math.isnan(v)]
        what = f"{len(xs)} {'steps' if x == 'step' else 'records with ' + x}"
        if xs:
            what += f" ({fmt(min(xs))} to {fmt(max(xs))})"
    notes = "".join(f"; {note}" for note in run.notes)
    if x is not None and (left := len(run.records) - len(xs)):
        notes += f"; {left} line{'s' if left > 1 else ''} without a numeric {x!r} left out"
    return f"{run.name}: {what} from {run.path}{notes}"


def list_keys(runs: Mapping[str, Run]) -> str:
    """``--list``: per run, every numeric key with its count of finite values and last value."""
    lines = []
    for run in runs.values():
        stats = key_stats(run.records)
        notes = "".join(f"; {note}" for note in run.notes)
        lines.append(
            f"{run.name}: {run.path}: {len(run.records)} records, {len(stats)} numeric keys{notes}"
        )
        width = max([3, *(len(k) for k in stats)])
        lines.append(f"  {'key':<{width}}  {'count':>6}  last")
        for key, (count, last) in stats.items():
            lines.append(f"  {key:<{width}}  {count:>6}  {fmt(last)}")
    return "\n".join(lines)


# ---- the command line ---------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help=f"a {METRICS_FILE}, a run directory holding one (tinker-sr demo --out, a "
        "tinker-cookbook log_path), or a directory of such run directories",
    )
    p.add_argument(
        "--keys",
        action="append",
        metavar="KEY[,KEY...]",
        help="metrics to draw, one panel each (repeatable). Default: reward-like, loss, KL and "
        "entropy keys, else the first few numeric keys",
    )
    p.add_argument(
        "--x",
        default="step",
        metavar="KEY",
        help="x axis: a numeric key, or 'index' for the record number (default step; a run "
        "without one uses the record number)",
    )
    p.add_argument(
        "--smooth",
        type=int,
        default=1,
        metavar="N",
        help="draw the trailing moving average over N points, the raw curve faint (default 1: "
        "raw only)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE.png",
        help=f"image to write (default {DEFAULT_PNG} beside the first PATH)",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="list each run's numeric keys with their count and last value; draw nothing",
    )


def _asked_keys(values: Sequence[str]) -> list[str]:
    keys = [k.strip() for value in values for k in value.split(",") if k.strip()]
    if not keys:
        raise PlotInputError("--keys: no key given")
    return list(dict.fromkeys(keys))


def _default_out(first: str) -> Path:
    path = Path(first).expanduser()
    return (path if path.is_dir() else path.parent) / DEFAULT_PNG


def _out_file(value: str) -> Path:
    """The file ``--out`` names: a directory gets the default name inside it, a name without
    an extension ``.png`` (as matplotlib would add it, so the path printed is the one written)."""
    out = Path(value).expanduser()
    if out.is_dir():
        return out / DEFAULT_PNG
    return out if out.suffix else out.with_name(out.name + ".png")


def _plot(args: argparse.Namespace) -> int:
    if args.smooth < 1:
        raise PlotInputError(f"--smooth must be at least 1 (1: no smoothing), got {args.smooth}")
    skipped: list[str] = []
    runs = load_runs(args.paths, skipped)
    for line in skipped:
        print(line)
    if args.list:
        print(list_keys(runs))
        return 0
    records = {name: run.records for name, run in runs.items()}
    xs = {name: resolve_x(run, args.x, records) for name, run in runs.items()}
    if args.keys:
        keys, why = check_keys(_asked_keys(args.keys), records), "--keys"
    else:
        keys, why = choose_keys(records, args.x)
        if not keys:
            raise PlotInputError("no numeric metric in any run: nothing to plot")
        why += "; choose with --keys, see all with --list"
    for name, run in runs.items():
        print(describe(run, xs[name]))
    print(f"keys: {', '.join(keys)} ({why})")
    out = _out_file(args.out) if args.out else _default_out(args.paths[0])
    title = next(iter(runs)) if len(runs) == 1 else f"{len(runs)} runs"
    if args.smooth > 1:
        title += f", moving average of {args.smooth}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        plot_curves(records, out, keys, title=title, x=xs, smooth=args.smooth)
    except ImportError as e:  # the extra is not installed: the numbers, in the terminal
        print(f"no PNG: matplotlib is not available ({e}); {INSTALL_HINT} to get one")
        print(text_summary(records, keys, xs, args.smooth))
        return 0
    except (OSError, ValueError) as e:
        raise PlotInputError(f"cannot write {out} ({e}); choose another file with --out") from None
    print(f"wrote {out}")
    return 0


def main(args: argparse.Namespace) -> int:
    """Run ``tinker-sr plot`` from parsed ``args`` (see `add_arguments`); returns the exit code."""
    try:
        return _plot(args)
    except PlotInputError as e:
        print(f"tinker-sr plot: {e}", file=sys.stderr)
        return 2
