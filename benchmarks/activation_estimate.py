"""The activation estimate against what a training step's forward really keeps for backward.

`model.activation_bytes` is what the automatic activation checkpointing decides on
(`model.checkpoint_pays`): an estimate under the real size lets a long datum run out of memory
instead of checkpointing. This script runs one LoRA ``forward_backward`` on engine_vs_hf.py's
random ~42M-parameter models (``--arch qwen3`` and ``qwen3_5`` by default, an HF directory
with its BPE tokenizer each) and counts every tensor autograd saves during the forward
(`tinker_sr.testing.saved_activations`: saved-tensor hooks; weights left out; each storage
once), beside the estimate for the same tokens. Counts, not timings: the same on any machine.

    python benchmarks/activation_estimate.py
    python benchmarks/activation_estimate.py --arch qwen3_5 --lengths 2048
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_vs_hf import RANK, make_model_dir  # noqa: E402
from mixed_lengths import make_data  # noqa: E402

MIB = 1 << 20


def count_saved(lengths: list[int], arch: str) -> tuple[int, int]:
    """(bytes the forward saved for backward, `activation_bytes` for the same call)."""
    import tinker_sr as tinker
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.testing.saved_activations import counting_saved_activations

    with tempfile.TemporaryDirectory() as tmp, counting_saved_activations() as counted:
        model_dir = make_model_dir(Path(tmp) / "model", arch)
        service = tinker.ServiceClient(backend=LocalBackend(Path(tmp) / "store"))
        client = service.create_lora_training_client(
            base_model=str(model_dir), rank=RANK, seed=0, train_unembed=False
        ).result()
        client.forward_backward(make_data(lengths), "cross_entropy").result()
    return counted["saved"], counted["estimate"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["qwen3", "qwen3_5"], action="append")
    parser.add_argument("--lengths", default=",".join(["256"] * 8), help="comma-separated")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    for arch in args.arch or ["qwen3", "qwen3_5"]:
        saved, estimate = count_saved(lengths, arch)
        print(
            f"{arch}, datums of {lengths} tokens: saved {saved / MIB:.0f} MiB, estimated "
            f"{estimate / MIB:.0f} MiB (saved / estimate {saved / estimate:.2f})"
        )


if __name__ == "__main__":
    main()
