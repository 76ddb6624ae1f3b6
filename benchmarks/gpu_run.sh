#!/usr/bin/env bash
# The goal-6 checks on a lent CUDA machine, as one call (docs/performance.md, "GPU").
#
#   bash benchmarks/gpu_run.sh            # logs to $OUT (default /tmp/tinker-sr-gpu)
#
# Runs from a checkout without installing it (PYTHONPATH). On a machine with torch but not
# the project's other requirements and no network, bring them as wheels and install them first:
#   pip download --no-deps -d .whl pydantic pydantic-core annotated-types typing-inspection \
#       typing_extensions zstandard uvicorn starlette respx 'protobuf>=7.35.1,<8' \
#       tinker==0.38.0 distro h2 hpack hyperframe orjson pyqwest opentelemetry-api sniffio
#   (with --python-version / --platform for the target), then there:
#   pip install --no-index --no-deps .whl/*.whl
# In order, each with a time cap:
#  0. the CUDA-graph decode (engine/cuda_graphs.py): tests/engine/test_cuda_graphs.py, then
#     benchmarks/cuda_graphs.py (graphs vs eager decode, one request and 32 at once);
#  1. benchmarks/gpu_check.py on tinker-sr/small: a LoRA step and 8 x 128 samples on cpu, cuda
#     and cuda + bf16, the fp32 loss / log-probs against the CPU's, then every policy loss on
#     StableReinforce provenance datums on each device (exits non-zero on a failed tolerance);
#  2. tests/engine/test_device.py (its CUDA test runs only where there is a GPU);
#  3. gpu_check.py again on a 42M-parameter Qwen3 HF directory (benchmarks/engine_vs_hf.py's
#     sizes, random weights) at 16 x 256, the training batch;
#  4. the loss, StableReinforce, custom-loss, checkpoint, architecture, Qwen3.5, sampling,
#     RL-loop and official-SDK tests with TINKER_SR_DEVICE=cuda (their `tinker-sr serve` subprocesses
#     inherit it); tests written for the CPU: a failure is either a tolerance that assumes CPU
#     arithmetic or a device bug, and the summary says which test. The official-SDK tests need
#     tinker==0.38.0 and its requirements among the wheels.
set -u
OUT=${OUT:-/tmp/tinker-sr-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() { echo "=== $1 ($(date +%T))"; }
step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "(no nvidia-smi)"
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available())"
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: nothing to check (python benchmarks/gpu_check.py --dry-run-on-cpu runs its code on the CPU)"
    exit 2
fi
step "0. CUDA-graph decode"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_cuda_graphs.py 2>&1 |
    tee "$OUT/cuda_graphs_tests.log" | tail -15
timeout 240 python3 benchmarks/cuda_graphs.py --rounds 2 2>&1 | grep -v "Writing model" |
    tee "$OUT/cuda_graphs_bench.log"
step "1. gpu_check tinker-sr/small"
timeout 240 python3 benchmarks/gpu_check.py 2>&1 | tee "$OUT/gpu_check_small.log"
echo "rc=${PIPESTATUS[0]}"
step "2. tests/engine/test_device.py"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_device.py 2>&1 | tail -5
step "3. gpu_check on a 42M Qwen3 HF directory"
timeout 60 python3 -c "
import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path
from engine_vs_hf import make_model_dir; make_model_dir(Path('/tmp/tsr-qwen3-42m'))" &&
    timeout 200 python3 benchmarks/gpu_check.py --model-dir /tmp/tsr-qwen3-42m --batch 16 \
        --seq 256 --no-losses 2>&1 | tee "$OUT/gpu_check_42m.log"
echo "rc=${PIPESTATUS[0]}"
step "4. tests with TINKER_SR_DEVICE=cuda"
TINKER_SR_DEVICE=cuda timeout "${GPU_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider \
    -p tinker_sr.testing.plugin --timeout 120 -rfE tests/test_losses.py \
    tests/test_stable_reinforce.py tests/test_custom_loss.py tests/engine/test_checkpoints.py \
    tests/test_hf_architectures.py tests/test_moe.py tests/engine/test_mixed_precision.py \
    tests/engine/test_sampler.py tests/test_batched_sampling.py tests/test_sampling_extras.py \
    tests/test_rl_loop.py tests/test_provenance_validate.py tests/test_official_sdk.py \
    tests/test_qwen3_5.py \
    2>&1 | tee "$OUT/tests_cuda.log" | tail -60
step "done"
