"""Off-policy stability benchmark: the demo task under real sampler stress, per loss and seed.

Grid: stress setting (none | stale | bf16 | both) x loss (StableReinforce with kl_coeff 0 and
0.01, importance_sampling, ppo, cispo, plain REINFORCE) x seeds. Every run is the RL loop of
`tinker_sr.demo` (public API only) on a fresh embedded engine built with
``LocalBackend(sampler_dtype=..., sampler_staleness=...)``, so the stress is real: a stale
sampler really samples with the adapter weights of k optimizer steps ago, a bf16 sampler
really computes in bfloat16 while the learner stays in float32.

Per run: ``<out>/runs/<stress>/<variant>/seed<N>.jsonl``, one line per step (reward, KL
sampler-vs-learner, entropy estimate, gradient norm, importance-ratio extremes, divergence
events), then ``<out>/summary.json`` and plots. Finished runs are skipped when the script is
run again with the same settings, so an interrupted grid resumes where it stopped.

    python benchmarks/stability.py            # full grid: 120 runs, ~12 min on 2 idle CPU cores
    python benchmarks/stability.py --quick    # smoke version: 1 seed, 25 steps, ~1-2 minutes
    python benchmarks/stability.py --images docs/images \
        --summary-json docs/images/stability_summary.json   # what docs/stability.md shows

Results go to ``runs/stability`` (``runs/stability-quick`` with --quick) unless --out is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from tinker_sr.demo import RLConfig, open_service_client, rl_loop  # noqa: E402

STRESSES = ("none", "stale", "bf16", "both")
# variant name -> (loss, loss_fn_config)
VARIANTS: dict[str, tuple[str, dict[str, float] | None]] = {
    "stable_reinforce(kl=0)": ("stable_reinforce", {"kl_coeff": 0.0}),
    "stable_reinforce(kl=0.01)": ("stable_reinforce", {"kl_coeff": 0.01}),
    "importance_sampling": ("importance_sampling", None),
    "ppo": ("ppo", None),
    "cispo": ("cispo", None),
    "reinforce": ("reinforce", None),
}

# Divergence events (see docs/stability.md). A run "diverges" if any step has one.
KL_SPIKE = 1.0  # k3 estimate of KL(sampler || learner) per sampled token, in nats
COLLAPSE_DROP = 0.25  # reward falls this far below the run's best 3-step mean ...
COLLAPSE_WINDOW = 3  # ... as a 3-step mean


@dataclass(frozen=True)
class Grid:
    steps: int
    seeds: tuple[int, ...]
    stresses: tuple[str, ...]
    variants: tuple[str, ...]
    staleness: int
    base: RLConfig

    def key(self) -> dict[str, Any]:
        """What a finished run must match to be reused."""
        return {"steps": self.steps, "staleness": self.staleness, "base": asdict(self.base)}


def full_grid(steps: int, staleness: int) -> Grid:
    return Grid(
        steps=steps,
        seeds=(0, 1, 2, 3, 4),
        stresses=STRESSES,
        variants=tuple(VARIANTS),
        staleness=staleness,
        base=RLConfig(steps=steps),
    )


def quick_grid(staleness: int) -> Grid:
    return Grid(
        steps=25,
        seeds=(0,),
        stresses=STRESSES,
        variants=tuple(VARIANTS),
        staleness=staleness,
        base=RLConfig(steps=25),
    )


def divergence_events(records: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Events per step: ``nonfinite`` (loss, gradient norm or KL not finite), ``kl_spike``
    (k3 KL above KL_SPIKE) and ``reward_collapse`` (first step whose trailing 3-step reward
    mean is COLLAPSE_DROP below the best earlier 3-step mean; counted once per run)."""
    events: list[list[str]] = []
    best = -math.inf
    collapsed = False
    rewards: list[float] = []
    for r in records:
        ev = []
        if not all(math.isfinite(float(r[k])) for k in ("loss", "grad_norm", "kl_k3")):
            ev.append("nonfinite")
        elif r["kl_k3"] > KL_SPIKE:
            ev.append("kl_spike")
        rewards.append(float(r["reward"]))
        if len(rewards) >= COLLAPSE_WINDOW:
            mean = float(np.mean(rewards[-COLLAPSE_WINDOW:]))
            if not collapsed and mean < best - COLLAPSE_DROP:
                ev.append("reward_collapse")
                collapsed = True
            best = max(best, mean)
        events.append(ev)
    return events


def run_path(out: Path, stress: str, variant: str, seed: int) -> Path:
    return out / "runs" / stress / variant / f"seed{seed}.jsonl"


def load_finished(path: Path, grid: Grid) -> list[dict[str, Any]] | None:
    """The step records of a finished run with the same settings, else None."""
    if not path.exists():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or lines[0].get("header") != grid.key():
        return None
    footer = lines[-1]
    if "finished" not in footer:
        return None
    return [r for r in lines[1:-1]]


def run_one(grid: Grid, stress: str, variant: str, seed: int, path: Path) -> list[dict[str, Any]]:
    loss, loss_config = VARIANTS[variant]
    config = replace(grid.base, loss=loss, loss_config=loss_config, seed=seed, steps=grid.steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    records: list[dict[str, Any]] = []
    error = None
    with tmp.open("w") as f:
        f.write(json.dumps({"header": grid.key()}) + "\n")

        def on_step(record: dict[str, Any]) -> None:
            records.append(record)

        try:
            with open_service_client(stress=stress, staleness=grid.staleness) as client:
                asyncio.run(rl_loop(client, config, on_step))
        except Exception as e:  # a failed request is a result too: record it, keep going
            error = f"{type(e).__name__}: {e}"
        events = divergence_events(records)
        if error is not None:
            events.append(["error"])
        for record, ev in zip(records, events, strict=False):
            f.write(json.dumps({**_compact(record), "events": ev}) + "\n")
        f.write(json.dumps({"finished": True, "error": error, "steps_done": len(records)}) + "\n")
    tmp.replace(path)
    return load_finished(path, grid) or []


def _compact(record: Mapping[str, Any]) -> dict[str, Any]:
    keep = (
        "step",
        "reward",
        "kl_sampler_learner",
        "kl_k3",
        "entropy",
        "grad_norm",
        "loss",
        "importance_ratio_max",
        "importance_ratio_min",
        "time_s",
    )
    return {k: record[k] for k in keep}


def final_reward(records: Sequence[Mapping[str, Any]], window: int = 5) -> float:
    if not records:
        return math.nan
    return float(np.mean([r["reward"] for r in records[-window:]]))


def summarize(out: Path, grid: Grid) -> dict[str, Any]:
    cells: dict[str, dict[str, Any]] = {}
    for stress in grid.stresses:
        for variant in grid.variants:
            runs = []
            for seed in grid.seeds:
                path = run_path(out, stress, variant, seed)
                lines = [json.loads(x) for x in path.read_text().splitlines()]
                records, footer = lines[1:-1], lines[-1]
                events = [e for r in records for e in r["events"]]
                if footer.get("error"):
                    events.append("error")
                runs.append(
                    {
                        "seed": seed,
                        "final_reward": final_reward(records),
                        "max_reward": max((r["reward"] for r in records), default=math.nan),
                        "mean_kl_k3": float(np.mean([r["kl_k3"] for r in records])),
                        "max_kl_k3": float(np.max([r["kl_k3"] for r in records])),
                        "final_entropy": float(np.mean([r["entropy"] for r in records[-5:]])),
                        "max_grad_norm": float(np.nanmax([r["grad_norm"] for r in records])),
                        "max_importance_ratio": float(
                            np.max([r["importance_ratio_max"] for r in records])
                        ),
                        "events": {e: events.count(e) for e in sorted(set(events))},
                        "diverged": bool(events),
                        "error": footer.get("error"),
                    }
                )
            finals = np.array([r["final_reward"] for r in runs])
            cells[f"{stress}/{variant}"] = {
                "stress": stress,
                "variant": variant,
                "final_reward_mean": float(np.nanmean(finals)),
                "final_reward_std": float(np.nanstd(finals, ddof=1)) if len(runs) > 1 else 0.0,
                "final_reward_min": float(np.nanmin(finals)),
                "final_reward_max": float(np.nanmax(finals)),
                "runs_diverged": sum(r["diverged"] for r in runs),
                "runs_with": {
                    e: sum(e in r["events"] for r in runs)
                    for e in ("reward_collapse", "kl_spike", "nonfinite", "error")
                },
                "median_mean_kl_k3": float(np.median([r["mean_kl_k3"] for r in runs])),
                "runs": runs,
            }
    return {
        "grid": {
            "steps": grid.steps,
            "seeds": list(grid.seeds),
            "stresses": list(grid.stresses),
            "variants": list(grid.variants),
            "staleness": grid.staleness,
            "config": asdict(grid.base),
        },
        "divergence": {
            "kl_spike_k3": KL_SPIKE,
            "reward_collapse_drop": COLLAPSE_DROP,
            "reward_collapse_window": COLLAPSE_WINDOW,
        },
        "engine_commit": ENGINE_COMMIT,
        "cells": cells,
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


# The code that runs is the code at start-up, whatever lands while the grid runs.
ENGINE_COMMIT = _git_commit()


def markdown_tables(summary: Mapping[str, Any]) -> str:
    """Final reward, divergence events and KL, one row per loss and one column per stress."""
    grid = summary["grid"]
    n = len(grid["seeds"])
    head = "| loss | " + " | ".join(_stress_label(s, grid["staleness"]) for s in grid["stresses"])
    rule = "|---" * (1 + len(grid["stresses"])) + "|"

    def table(title: str, cell: Any) -> list[str]:
        lines = [title, "", head + " |", rule]
        for variant in grid["variants"]:
            row = [f"`{variant}`"]
            row += [cell(summary["cells"][f"{s}/{variant}"]) for s in grid["stresses"]]
            lines.append("| " + " | ".join(row) + " |")
        return [*lines, ""]

    def reward(c: Mapping[str, Any]) -> str:
        return (
            f"{c['final_reward_mean']:.3f} ± {c['final_reward_std']:.3f} "
            f"[{c['final_reward_min']:.2f}, {c['final_reward_max']:.2f}]"
        )

    def events(c: Mapping[str, Any]) -> str:
        w = c["runs_with"]
        text = f"{w['reward_collapse']} / {w['kl_spike']} / {w['nonfinite']}"
        return text + (f" (+{w['error']} failed)" if w["error"] else "")

    return "\n".join(
        table(
            f"Final reward (mean of the last 5 steps): mean ± std over {n} seeds [min, max]",
            reward,
        )
        + table(
            f"Runs (of {n}) with a reward collapse / a KL spike / a non-finite loss or gradient",
            events,
        )
        + table(
            "KL(sampler ‖ learner) per token (k3), mean over the run, median over seeds",
            lambda c: f"{c['median_mean_kl_k3']:.1e}",
        )
    )


def _stress_label(stress: str, k: int) -> str:
    return {
        "none": "none",
        "stale": f"stale (k={k})",
        "bf16": "bf16 sampler",
        "both": f"bf16 + stale (k={k})",
    }[stress]


def plot(out: Path, images: Path, grid: Grid) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label, log in (
        ("reward", "reward", False),
        ("kl_k3", "KL(sampler ‖ learner) per token (k3)", True),
        ("entropy", "sampler entropy per token (nats)", False),
        ("grad_norm", "gradient norm", True),
    ):
        ncols = 2 if len(grid.stresses) > 1 else 1
        nrows = math.ceil(len(grid.stresses) / ncols)
        fig, axes = plt.subplots(
            nrows, ncols, figsize=(6 * ncols, 3.6 * nrows), sharex=True, sharey=True, squeeze=False
        )
        for ax, stress in zip(axes.flat, grid.stresses, strict=False):
            for i, variant in enumerate(grid.variants):
                curves = []
                for seed in grid.seeds:
                    lines = run_path(out, stress, variant, seed).read_text().splitlines()
                    curves.append([json.loads(x)[key] for x in lines[1:-1]])
                length = min(len(c) for c in curves)
                if length == 0:
                    continue
                arr = np.array([c[:length] for c in curves], dtype=float)
                if log:
                    arr = np.where(arr > 0, arr, np.nan)
                mean = np.nanmean(arr, axis=0)
                color = f"C{i}"
                # Several losses coincide on-policy; dashes keep overlapping lines visible.
                style = ("-", "--", "-.", ":")[i % 4]
                ax.plot(range(length), mean, color=color, ls=style, lw=1.6, label=variant)
                if len(curves) > 1:
                    ax.fill_between(
                        range(length),
                        np.nanmin(arr, axis=0),
                        np.nanmax(arr, axis=0),
                        color=color,
                        alpha=0.12,
                        lw=0,
                    )
            if log:
                ax.set_yscale("log")
            ax.set_title(_stress_label(stress, grid.staleness), fontsize=10)
            ax.grid(alpha=0.3)
        for ax in axes[-1]:
            ax.set_xlabel("step")
        axes[0, 0].legend(fontsize=7, loc="best")
        fig.suptitle(f"{label}: mean over seeds {list(grid.seeds)} (band: min-max)", fontsize=11)
        fig.tight_layout()
        path = images / f"stability_{key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results directory (default runs/stability)")
    parser.add_argument("--images", default=None, help="where to write the PNGs (default: --out)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke version: 1 seed, 25 steps, ~1-2 minutes"
    )
    parser.add_argument("--steps", type=int, default=80, help="RL steps per run (default 80)")
    parser.add_argument("--staleness", type=int, default=3, help="k for stale (default 3)")
    parser.add_argument("--summary-json", default=None, help="also copy summary.json here")
    args = parser.parse_args(argv)

    grid = quick_grid(args.staleness) if args.quick else full_grid(args.steps, args.staleness)
    out = Path(args.out or ("runs/stability-quick" if args.quick else "runs/stability"))
    images = Path(args.images) if args.images else out
    cells = [(s, v, seed) for s in grid.stresses for v in grid.variants for seed in grid.seeds]
    print(
        f"stability grid: {len(grid.stresses)} stress settings x {len(grid.variants)} losses x "
        f"{len(grid.seeds)} seeds = {len(cells)} runs of {grid.steps} steps -> {out}",
        flush=True,
    )
    t_start = time.perf_counter()
    ran = 0
    for i, (stress, variant, seed) in enumerate(cells, 1):
        path = run_path(out, stress, variant, seed)
        label = f"[{i:3d}/{len(cells)}] {stress:5s} {variant:26s} seed {seed}"
        records = load_finished(path, grid)
        if records is not None:
            print(f"{label}: done earlier, skipped", flush=True)
            continue
        t0 = time.perf_counter()
        records = run_one(grid, stress, variant, seed, path)
        ran += 1
        events = [e for r in records for e in r["events"]]
        per_run = (time.perf_counter() - t_start) / ran
        eta = per_run * sum(
            1 for s, v, sd in cells[i:] if load_finished(run_path(out, s, v, sd), grid) is None
        )
        print(
            f"{label}: reward {records[0]['reward'] if records else math.nan:.3f} -> "
            f"{final_reward(records):.3f}, max KL {max((r['kl_k3'] for r in records), default=0):.1e}"
            f", events {sorted(set(events)) or '-'} ({time.perf_counter() - t0:.0f} s, "
            f"eta {eta / 60:.1f} min)",
            flush=True,
        )

    summary = summarize(out, grid)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = markdown_tables(summary)
    (out / "tables.md").write_text(table)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
    pngs = plot(out, images, grid)
    print()
    print(table)
    print(f"\nsummary: {out / 'summary.json'}")
    for p in pngs:
        print(f"plot:    {p}")
    print(f"total {(time.perf_counter() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
