"""What loading a Hugging Face directory pays for its safety checks.

`tinker_sr.engine.hf.load_model_dir` refuses a weight holding NaN or infinity, or a value beyond
the dtype it loads in (`checkpoints.count_nonfinite`: a sum per tensor, element-wise only when
the sum is not finite), and reads every tensor's dtype from the safetensors headers. This script
loads one directory with the checks and with the finiteness test replaced by a no-op, in this
process, alternating the order over rounds, and reports the time of each and their ratio. The
directory is a random bfloat16 model of Qwen3-0.6B's shapes (1.2 GB of weights, written once
into a temporary directory), or one given with ``--model-dir``. The load reads the files from
the page cache after the first round (the first round is a warm-up and is not counted).

    python benchmarks/load_checks.py                  # Qwen3-0.6B's shapes, bf16, 4 rounds
    python benchmarks/load_checks.py --model-dir DIR --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
sys.path.insert(0, str(REPO / "benchmarks"))

from user_trial import real_size_dir  # noqa: E402 - beside this script


def _load_seconds(model_dir: Path, checked: bool) -> float:
    import gc

    from tinker_sr.engine import hf

    patch = (
        mock.patch.object(hf, "count_nonfinite", lambda tensor: 0)
        if not checked
        else mock.patch.object(hf, "count_nonfinite", hf.count_nonfinite)
    )
    gc.collect()
    with patch:
        start = time.perf_counter()
        model = hf.load_model_dir(model_dir)
        seconds = time.perf_counter() - start
    del model
    gc.collect()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    from tinker_sr.engine.cpu import describe_machine

    print(describe_machine())
    with tempfile.TemporaryDirectory(prefix="tinker-sr-load-") as tmp:
        model_dir = args.model_dir or real_size_dir(Path(tmp))
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        print(f"model {model_dir}: {size / 2**30:.2f} GiB of safetensors")
        _load_seconds(model_dir, True)  # warm-up: the files into the page cache
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for checked in (True, False) if r % 2 == 0 else (False, True):
                times[checked].append(_load_seconds(model_dir, checked))
        ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
        for checked in (True, False):
            label = "with the checks   " if checked else "finiteness skipped"
            print(
                f"{label}: median {statistics.median(times[checked]):.3f} s "
                f"(rounds {', '.join(f'{t:.3f}' for t in times[checked])})"
            )
        print(
            f"checked / unchecked: {statistics.median(ratios):.3f}x "
            f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})"
        )


if __name__ == "__main__":
    main()
