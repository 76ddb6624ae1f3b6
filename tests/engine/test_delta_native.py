"""The C kernels of Qwen3.5's gated delta rule (`engine.delta_native`, ``csrc/delta_rule.c``).
The chunked form's batched triangular solve: torch's solve in values and gradients, float32
and float64, the same bits at any thread count, torch's own solve where the C kernels are off.
The decode step: torch's form in values, the state advanced in place, a row's bits the same
alone as in a batch, and what the kernel cannot take left to torch."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tinker_sr.engine import compiled, delta_native, hybrid
from tinker_sr.engine.hybrid import DECAY_FLOOR, gated_delta_step


def _c_kernels() -> bool:
    return compiled.native_mode() != "off" and delta_native._library() is not None


def _operands(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    system = torch.randn(3, 5, 64, 64, generator=gen, dtype=dtype) * 0.2
    system[0, 1, 7] = 0.0  # a zeroed row (the gated delta rule's rows past the decay floor)
    return system, torch.randn(3, 5, 64, 48, generator=gen, dtype=dtype)


def _solve_and_grads(fn, system, rhs, weights):  # type: ignore[no-untyped-def]
    a, b = system.clone().requires_grad_(), rhs.clone().requires_grad_()
    out = fn(a, b)
    (out * weights).sum().backward()
    return out.detach(), a.grad, b.grad


def _torch_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)


# float32: 3e-5, as a build without FMA (x86-64-v2) or torch without AVX rounds (a hunt: 2.1e-5).
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 3e-5), (torch.float64, 1e-12)])
def test_the_c_solve_is_torchs_in_values_and_gradients(dtype: torch.dtype, tol: float) -> None:
    if not _c_kernels():
        pytest.skip("the C kernels are off or unavailable: torch's solve runs")
    system, rhs = _operands(dtype)
    assert delta_native.native_solve_ready(system, rhs)
    weights = torch.randn(rhs.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ours = _solve_and_grads(delta_native.unit_lower_solve, system, rhs, weights)
    theirs = _solve_and_grads(_torch_solve, system, rhs, weights)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert torch.equal(ours[1].triu(), torch.zeros_like(ours[1]))  # the diagonal is not read


def test_only_the_inputs_that_need_a_gradient_get_one() -> None:
    system, rhs = _operands(torch.float32)
    for needs in ((True, False), (False, True)):
        a, b = system.clone().requires_grad_(needs[0]), rhs.clone().requires_grad_(needs[1])
        delta_native.unit_lower_solve(a, b).sum().backward()
        assert (a.grad is not None, b.grad is not None) == needs


def test_the_same_bits_at_any_thread_count() -> None:
    system, rhs = _operands(torch.float32, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = delta_native.unit_lower_solve(system, rhs)
        torch.set_num_threads(max(2, threads))
        many = delta_native.unit_lower_solve(system, rhs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_torchs_solve_runs_where_the_c_kernels_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    system, rhs = _operands(torch.float32)
    assert not delta_native.native_solve_ready(system, rhs)
    out = delta_native.unit_lower_solve(system.requires_grad_(), rhs)
    assert type(out.grad_fn).__name__.startswith("LinalgSolveTriangular")
    assert torch.equal(out, _torch_solve(system, rhs))


def _step_operands(rows: int = 3, heads: int = 4, dk: int = 16, dv: int = 24) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    q, k = (
        torch.nn.functional.normalize(torch.randn(rows, heads, dk, generator=gen), dim=-1)
        for _ in "qk"
    )
    v = torch.randn(rows, heads, dv, generator=gen)
    g = -torch.rand(rows, heads, generator=gen) * 3
    g[0, :2] = torch.tensor([-50.0, -95.0])  # under the floor; exp(-95) is a subnormal float
    beta = torch.rand(rows, heads, generator=gen)
    return [q, k, v, g, beta, torch.randn(rows, heads, dk, dv, generator=gen)]


def test_the_c_decode_step_is_torchs_and_advances_the_state_in_place() -> None:
    if not _c_kernels():
        pytest.skip("the C kernels are off or unavailable: torch's step runs")
    *inputs, state = _step_operands()
    want_out, want_state = gated_delta_step(*inputs, state)
    ours = state.clone()
    out = delta_native.gated_delta_step_(*inputs, ours, DECAY_FLOOR)
    assert out is not None
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, want_state, rtol=1e-5, atol=1e-6)
    # Each row alone gives the same bits as the batch (decode batches many requests).
    for r in range(state.shape[0]):
        alone = state[r : r + 1].clone()
        row = delta_native.gated_delta_step_(*(t[r : r + 1] for t in inputs), alone, DECAY_FLOOR)
        assert row is not None and torch.equal(row, out[r : r + 1])
        assert torch.equal(alone, ours[r : r + 1])


def test_the_decode_step_leaves_what_the_kernel_cannot_take_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    *inputs, state = _step_operands()
    before = state.clone()
    wide = [t.double() for t in inputs]
    assert delta_native.gated_delta_step_(*wide, state.double(), DECAY_FLOOR) is None  # float64
    strided = state.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert delta_native.gated_delta_step_(*inputs, strided, DECAY_FLOOR) is None  # not contiguous
    assert (
        delta_native.gated_delta_step_(*inputs, state[:, :2], DECAY_FLOOR) is None
    )  # shapes disagree
    monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    assert delta_native.gated_delta_step_(*inputs, state, DECAY_FLOOR) is None
    assert torch.equal(state, before)  # nothing done


def _rule_operands(
    B: int, T: int, H: int, dk: int, dv: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (
        torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1) for _ in "qk"
    )
    v = torch.randn(B, T, H, dv, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 3
    g[0, min(5, T - 1), 0] = -60.0  # under the floor
    beta = torch.rand(B, T, H, generator=gen)
    return [t.to(dtype) for t in (q, k, v, g, beta)]


def _rule_and_grads(
    inputs: list[torch.Tensor], state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    leaves = [t.clone().requires_grad_() for t in inputs]
    start = None if state is None else state.clone().requires_grad_()
    out, final = hybrid.gated_delta_rule(*leaves, start)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.dtype)
    grads = torch.autograd.grad(
        (out * weights).sum() + final.square().sum(),
        leaves + ([start] if start is not None else []),
    )
    return out.detach(), final.detach(), grads


def _matches_the_chunked_form(
    inputs: list[torch.Tensor],
    state: torch.Tensor | None,
    monkeypatch: pytest.MonkeyPatch,
    values: tuple[float, float],
    grads: tuple[float, float],
) -> None:
    """The C rule's outputs and gradients against the chunked form's (the C kernels off then),
    within (rtol, atol) ``values`` and ``grads``."""
    ours = _rule_and_grads(inputs, state)
    monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    want = _rule_and_grads(inputs, state)
    monkeypatch.undo()
    for a, b in zip(ours[:2], want[:2], strict=True):
        torch.testing.assert_close(a, b, rtol=values[0], atol=values[1])
    for a, b in zip(ours[2], want[2], strict=True):
        torch.testing.assert_close(a, b, rtol=grads[0], atol=grads[1])


@pytest.mark.parametrize("length", [1, 64, 150])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("widths", [(16, 24), (64, 64), (128, 128)])
def test_the_c_rule_is_the_chunked_forms_in_values_and_gradients(
    length: int, with_state: bool, widths: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32, chunk boundaries crossed or not, a decay under the floor, a starting state or
    none, key and value widths the kernel has fixed-width loops for (64, 128) and others: the
    C rule (position by position) against the chunked form torch runs with the C kernels off."""
    if not _c_kernels():
        pytest.skip("the C kernels are off or unavailable: the chunked form runs")
    dk, dv = widths
    inputs = _rule_operands(2, length, 3, dk, dv)
    state = torch.randn(2, 3, dk, dv, generator=torch.Generator().manual_seed(4))
    start = state if with_state else None
    _matches_the_chunked_form(inputs, start, monkeypatch, (1e-4, 1e-5), (1e-3, 1e-4))


def test_the_c_rule_is_the_same_bits_alone_in_a_batch_at_any_thread_count() -> None:
    """Each (row, head) pair runs whole in one thread: a row's values and gradients do not
    depend on the rows beside it or on the thread count; without autograd the forward gives
    the same values."""
    if not _c_kernels():
        pytest.skip("the C kernels are off or unavailable: the chunked form runs")
    inputs = _rule_operands(4, 200, 2, 64, 64, seed=1)  # over the one-thread threshold
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = _rule_and_grads(inputs, None)
        torch.set_num_threads(1)
        one = _rule_and_grads(inputs, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert all(torch.equal(a, b) for a, b in zip(one[2], two[2], strict=True))
    alone = _rule_and_grads([t[2:3] for t in inputs], None)
    assert torch.equal(alone[0], two[0][2:3]) and torch.equal(alone[1], two[1][2:3])
    with torch.no_grad():
        out, final = hybrid.gated_delta_rule(*inputs)
    assert torch.equal(out, two[0]) and torch.equal(final, two[1])


def test_the_rule_leaves_what_the_kernel_cannot_take_to_the_chunked_form() -> None:
    inputs = _rule_operands(1, 8, 1, 4, 4)
    assert delta_native.delta_rule(*inputs[:4], inputs[4].double(), None, -30.0, 64) is None
    wide = _rule_operands(1, 8, 1, 4, 1025)
    assert delta_native.delta_rule(*wide, None, -30.0, 64) is None  # Dv over 1,024
    half = [t.half() for t in inputs]
    assert delta_native.delta_rule(*half, None, -30.0, 64) is None
    q, k, v, g, beta = inputs
    assert delta_native.delta_rule(q, k[:, :4], v, g, beta, None, -30.0, 64) is None
    assert delta_native.delta_rule(q, k, v, g[..., None], beta, None, -30.0, 64) is None
    state = torch.zeros(1, 1, 4, 5)  # not [B, H, Dk, Dv]
    assert delta_native.delta_rule(q, k, v, g, beta, state, -30.0, 64) is None


def test_wide_states_recompute_in_parts_and_keep_the_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float64 states of 256 x 256 (512 KB): backward recomputes each 64-position chunk 8
    positions at a time (its buffer stays within 4 MiB), from states it marks first; values and
    gradients are still the chunked form's, a partial last chunk included."""
    if not _c_kernels():
        pytest.skip("the C kernels are off or unavailable: the chunked form runs")
    inputs = _rule_operands(1, 130, 1, 256, 256, dtype=torch.float64, seed=3)
    state = torch.randn(1, 1, 256, 256, generator=torch.Generator().manual_seed(5)).double()
    _matches_the_chunked_form(inputs, state, monkeypatch, (1e-9, 1e-9), (1e-8, 1e-8))


@pytest.mark.parametrize(
    ("widths", "dtype"),
    [((128, 128), torch.float32), ((48, 192), torch.float32), ((128, 128), torch.float64)],
)
def test_the_forward_in_column_blocks_is_the_same_bits_as_whole_rows(
    widths: tuple[int, int], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward takes a wide state's columns in blocks of 64 through all positions (with
    512-bit vectors where GCC would pick 256), the decode step whole rows with them: outputs,
    the final state and the states kept for backward are the same bits as the build that runs
    whole rows at 256 bits (``TSR_RULE_NARROW``, the benchmark's baseline), chunk edges, a
    partial last chunk and a starting state included."""
    if not _c_kernels():
        pytest.skip("the C kernels are off or unavailable: the chunked form runs")
    narrow = delta_native._library(("TSR_RULE_NARROW",))
    if narrow is None:
        pytest.skip("the baseline build of the rule is unavailable")
    dk, dv = widths
    inputs = [t.to(dtype) for t in _rule_operands(2, 150, 2, dk, dv, seed=6)]
    state = torch.randn(2, 2, dk, dv, generator=torch.Generator().manual_seed(7)).to(dtype)
    blocked = delta_native._rule_forward(inputs, state, -30.0, 64, keep=True)
    monkeypatch.setattr(delta_native, "_library", lambda: narrow)
    whole = delta_native._rule_forward(inputs, state, -30.0, 64, keep=True)
    assert torch.equal(blocked[0], whole[0]) and torch.equal(blocked[1], whole[1])
    assert torch.equal(blocked[2][-1], whole[2][-1])  # the saved states
    if dtype == torch.float32:  # the decode step (float32 only)
        one = [t[:, 0].contiguous() for t in inputs]
        whole_state = state.clone()
        whole_out = delta_native.gated_delta_step_(*one, whole_state, -30.0)  # narrow build
        monkeypatch.undo()
        wide_state = state.clone()
        wide_out = delta_native.gated_delta_step_(*one, wide_state, -30.0)
        assert wide_out is not None and whole_out is not None
        assert torch.equal(wide_out, whole_out) and torch.equal(wide_state, whole_state)


@pytest.mark.parametrize(
    ("widths", "dtype"),
    [
        ((64, 64), torch.float32),
        ((128, 128), torch.float32),
        ((48, 64), torch.float32),
        ((32, 64), torch.float64),
        ((16, 24), torch.float32),
    ],
)
@pytest.mark.parametrize("length", [129, 150])
@pytest.mark.parametrize("build", [(), ("TSR_RULE_VECTOR_BYTES=32",)], ids=["own", "32-byte"])
def test_the_backward_in_vectors_is_the_plain_backward_within_rounding(
    widths: tuple[int, int],
    dtype: torch.dtype,
    length: int,
    build: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the CPU has AVX2 or AVX-512 the backward runs in explicit vectors of its width
    (32 or 64 bytes; a build of 32 bytes tested on either), a state's rows a vector's lanes
    at a time with their sums reduced together, its recomputed states in one pass: the
    gradients are the build's before it (``TSR_RULE_PLAIN_BACKWARD``, the benchmark's
    baseline) within rounding, at widths it takes (64, 128; rows in groups of 16 or 8 float32,
    8 or 4 float64) and one it leaves to the plain loops (16 x 24), a chunk of one position
    (129) and a starting state included. The forward is the same bits."""
    if not _c_kernels():
        pytest.skip("the C kernels are off or unavailable: the chunked form runs")
    plain = delta_native._library(("TSR_RULE_PLAIN_BACKWARD",))
    vectors = delta_native._library(build)
    if plain is None or vectors is None:
        pytest.skip("a build of the rule is unavailable")
    dk, dv = widths
    inputs = [t.to(dtype) for t in _rule_operands(2, length, 2, dk, dv, seed=8)]
    state = torch.randn(2, 2, dk, dv, generator=torch.Generator().manual_seed(2)).to(dtype)
    monkeypatch.setattr(delta_native, "_library", lambda *_: vectors)
    ours = _rule_and_grads(inputs, state)
    monkeypatch.setattr(delta_native, "_library", lambda *_: plain)
    want = _rule_and_grads(inputs, state)
    assert torch.equal(ours[0], want[0]) and torch.equal(ours[1], want[1])
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for a, b in zip(ours[2], want[2], strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


_STATES_PROGRAM = r"""
#include "delta_rule.c"
#include <stdio.h>
static float draw(unsigned *s) {
  *s = *s * 1103515245u + 12345u;
  return (*s >> 8) / 16777216.0f - 0.5f;
}
/* the state after a position and the next one's read: rule_step's vs rule_advance_v's */
int main(void) {
  enum { DK = 128, DV = 128 };
  static float prev[DK * DV], fwd[DK * DV], vec[DK * DV], k0[DK], k1[DK], q[DK], v0[DV], v1[DV];
  static float r0[DV], d0[DV], r1[DV], d1[DV], r[DV], d[DV], o[DV];
  unsigned s = 7;
  for (int i = 0; i < DK * DV; i++) prev[i] = draw(&s);
  for (int i = 0; i < DK; i++) { k0[i] = draw(&s); k1[i] = draw(&s); q[i] = draw(&s); }
  for (int i = 0; i < DV; i++) { v0[i] = draw(&s); v1[i] = draw(&s); }
  memcpy(fwd, prev, sizeof fwd);
  rule_step_f32(fwd, q, k0, v0, 0.93f, 0.4f, o, r0, d0, DK, DV, DV, 1.0f);
  rule_read_f32(fwd, k1, v1, 0.87f, 0.6f, r1, d1, DK, DV);
  rule_advance_v_f32(prev, vec, k0, d0, 0.93f, k1, v1, 0.87f, 0.6f, r, d, DK, DV);
  printf("%d %d\n", memcmp(vec, fwd, sizeof vec) != 0,
         memcmp(r, r1, sizeof r) != 0 || memcmp(d, d1, sizeof d) != 0);
  return 0;
}
"""


@pytest.mark.parametrize("build", [(), ("TSR_RULE_VECTOR_BYTES=32",)], ids=["own", "32-byte"])
def test_the_backwards_recomputed_states_are_the_forwards_bits(
    build: tuple[str, ...], tmp_path: Path
) -> None:
    """The backward's recomputed state (one vector pass: the previous position's decay and
    step, this one's read) is the forward's to the bit, with the build's compiler and flags:
    the decayed product is rounded alone before the step's fused multiply-add, as the
    forward's two passes round it (GNU C may otherwise fuse it instead)."""
    from tinker_sr.engine import cpu, native

    cc = native._compiler()
    if cc is None or "avx2" not in cpu.isa_flags():
        pytest.skip("the backward's vectors run with a C compiler on a CPU with AVX2")
    source = tmp_path / "states.c"
    source.write_text(_STATES_PROGRAM)
    flags = [f for f in native.FLAGS if f not in ("-shared", "-fPIC")]
    program = tmp_path / "states"
    subprocess.run(
        [cc, *flags, *(f"-D{d}" for d in build), f"-I{native.SOURCE_DIR}", str(source),
         "-o", str(program), "-lm"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    out = subprocess.run([str(program)], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["0", "0"], "recomputed state, then r and d: 1 where they differ"


def _torch_conv(x: torch.Tensor, w: torch.Tensor, init: torch.Tensor | None) -> torch.Tensor:
    """The layer's torch form: silu(conv1d) over [B, C, T] with the window before x."""
    xt = x.transpose(1, 2)
    k = w.shape[-1]
    window = torch.nn.functional.pad(xt, (k - 1, 0)) if init is None else torch.cat([init, xt], -1)
    conv = torch.nn.functional.conv1d(window, w, groups=x.shape[-1])
    return torch.nn.functional.silu(conv).transpose(1, 2)


@pytest.mark.parametrize(("batch", "length", "channels"), [(3, 150, 80), (2, 64, 37), (1, 2, 16)])
def test_the_c_short_convolution_is_torchs_in_values_and_gradients(
    batch: int, length: int, channels: int
) -> None:
    """Forward and the input's gradient against torch's conv1d + silu, over unit boundaries
    (64 positions), channel counts off the 16-float vectors, and fewer positions than taps."""
    if not _c_kernels() or delta_native._deltanet_library() is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(batch, length, channels, generator=gen)
    w = torch.randn(channels, 1, 4, generator=gen)
    dy = torch.randn(batch, length, channels, generator=gen)
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = delta_native.short_conv_silu(got_x, w)
    assert got is not None and got.is_contiguous()
    want = _torch_conv(want_x, w, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (got * dy).sum().backward()
    (want * dy).sum().backward()
    torch.testing.assert_close(got_x.grad, want_x.grad, atol=1e-5, rtol=1e-5)
    init = torch.randn(batch, channels, 3, generator=gen)  # a decode cache's window
    with torch.no_grad():
        got = delta_native.short_conv_silu(x, w, init)
        assert got is not None
        torch.testing.assert_close(got, _torch_conv(x, w, init), atol=1e-5, rtol=1e-5)


def test_the_short_convolution_is_the_same_bits_at_any_thread_count() -> None:
    if not _c_kernels() or delta_native._deltanet_library() is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 200, 96, generator=gen, requires_grad=True)
    w = torch.randn(96, 1, 4, generator=gen)
    runs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            x.grad = None
            out = delta_native.short_conv_silu(x, w)
            assert out is not None
            (out * out).sum().backward()
            assert x.grad is not None
            runs.append((out.detach(), x.grad.clone()))
    finally:
        torch.set_num_threads(threads)
    for out, grad in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(grad, runs[0][1])


def test_the_short_convolution_leaves_what_it_cannot_take_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(2, 8, 16)
    w = torch.randn(16, 1, 4)
    assert delta_native.short_conv_silu(x.double(), w.double()) is None
    assert delta_native.short_conv_silu(x, w.clone().requires_grad_()) is None
    init = torch.randn(2, 16, 3)
    assert delta_native.short_conv_silu(x.clone().requires_grad_(), w, init) is None
    assert delta_native.short_conv_silu(x, w, init[:, :, :2]) is None
    assert delta_native.short_conv_silu(x, torch.randn(16, 1, 17)) is None  # over MAX_TAPS
    assert delta_native.short_conv_silu(x.to(torch.int32), w) is None  # not a float
    monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    assert delta_native.short_conv_silu(x, w) is None


def test_a_qwen3_5_layer_takes_the_c_convolution_with_the_same_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The DeltaNet layer's output and input gradient with the C convolution and with torch's
    (the C kernels' other passes the same both times)."""
    if not _c_kernels() or delta_native._deltanet_library() is None:
        pytest.skip("no C compiler here")
    from tests.engine._hybrid import tiny_hybrid_model

    layer = tiny_hybrid_model().model.layers[0].linear_attn
    assert isinstance(layer, hybrid.GatedDeltaNet)
    x = torch.randn(2, 70, layer.in_proj_q.in_features, generator=torch.Generator().manual_seed(0))
    calls: list[object] = []
    conv = delta_native.short_conv_silu
    results = []

    def recording(*args: torch.Tensor | None) -> torch.Tensor | None:
        calls.append(1)
        return conv(*args)  # type: ignore[arg-type]

    for way in (recording, lambda *args: None):
        monkeypatch.setattr(hybrid, "short_conv_silu", way)
        xi = x.clone().requires_grad_()
        out = layer(xi, 0, None, 0)
        out.square().sum().backward()
        results.append((out.detach(), xi.grad))
    assert calls == [1]
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-4, rtol=1e-4)


def _torch_gated_norm(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h * torch.nn.functional.silu(z)


@pytest.mark.parametrize("width", [64, 24])
def test_the_c_gated_norm_is_torchs_in_values_and_gradients(width: int) -> None:
    """y heads-major as the rule returns it (a transposed view): read through its strides,
    its gradient written with them; widths on and off the 16-float vectors."""
    if not _c_kernels() or delta_native._deltanet_library() is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(6)
    y_heads = torch.randn(2, 3, 70, width, generator=gen)  # [B, H, T, n]
    z = torch.randn(2, 70, 3, width, generator=gen)
    w = torch.rand(width, generator=gen) + 0.5
    dout = torch.randn(2, 70, 3, width, generator=gen)
    grads = []
    ways = (
        lambda y, z: delta_native.gated_rms_norm(y, z, w, 1e-6),
        lambda y, z: _torch_gated_norm(y, z, w),
    )
    for fn in ways:
        yh, zz = y_heads.clone().requires_grad_(), z.clone().requires_grad_()
        out = fn(yh.transpose(1, 2), zz)
        assert out is not None
        (out * dout).sum().backward()
        grads.append((out.detach(), yh.grad, zz.grad))
    (got, got_dy, got_dz), (want, want_dy, want_dz) = grads
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_dy, want_dy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_dz, want_dz, atol=1e-5, rtol=1e-5)
    decode = delta_native.gated_rms_norm(y_heads[:, :, 0], z[:, 0], w, 1e-6)  # [rows, H, n]
    assert decode is not None
    torch.testing.assert_close(decode, _torch_gated_norm(y_heads[:, :, 0], z[:, 0], w))


def test_the_gated_norm_is_the_same_bits_at_any_thread_count_and_alone_in_a_batch() -> None:
    if not _c_kernels() or delta_native._deltanet_library() is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(7)
    y, z = torch.randn(5, 40, 4, 64, generator=gen), torch.randn(5, 40, 4, 64, generator=gen)
    w = torch.rand(64, generator=gen)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(delta_native.gated_rms_norm(y, z, w, 1e-6))
    finally:
        torch.set_num_threads(threads)
    assert all(r is not None and torch.equal(r, runs[0]) for r in runs)
    alone = delta_native.gated_rms_norm(y[2:3], z[2:3], w, 1e-6)
    assert alone is not None and runs[0] is not None and torch.equal(alone, runs[0][2:3])


def test_the_gated_norm_leaves_what_it_cannot_take_to_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    y, z, w = (
        torch.randn(2, 3, 8, generator=gen),
        torch.randn(2, 3, 8, generator=gen),
        torch.ones(8),
    )
    assert delta_native.gated_rms_norm(y.double(), z.double(), w.double(), 1e-6) is None
    assert delta_native.gated_rms_norm(y, z, w.clone().requires_grad_(), 1e-6) is None
    assert delta_native.gated_rms_norm(y, z[:, :2], w, 1e-6) is None
    assert (
        delta_native.gated_rms_norm(y.transpose(1, 2), z.transpose(1, 2), torch.ones(3), 1e-6)
        is None
    )
    layer = hybrid.GatedRMSNorm(8, 1e-6)  # its own forward: torch's form for float64
    out = layer(y.double(), z.double())
    # which computes in float32 (as transformers does), so float32's tolerance: float64's
    # (1e-7) failed one run in a CI suite on unseeded inputs (5.3e-7 apart)
    want = _torch_gated_norm(y.double(), z.double(), torch.ones(8).double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize(("key_heads", "heads", "dk", "dv"), [(2, 4, 64, 64), (3, 3, 24, 40)])
def test_the_c_heads_are_torchs_in_values_and_gradients(
    key_heads: int, heads: int, dk: int, dv: int
) -> None:
    """q, k normalised and repeated per value head, v: the layer's torch form, heads-major
    underneath, over unit boundaries (64 positions) and widths off the 16-float vectors."""
    if not _c_kernels() or delta_native._deltanet_library() is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(8)
    B, T = 2, 70
    mixed = torch.randn(B, T, 2 * key_heads * dk + heads * dv, generator=gen)
    mixed[0, 3, :dk] = 0.0  # a zero row: the norm's eps keeps it finite
    upstream = [torch.randn(B, T, heads, d, generator=gen) for d in (dk, dk, dv)]

    def torch_heads(m: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = m.split([key_heads * dk, key_heads * dk, heads * dv], -1)
        rep = heads // key_heads
        q, k = (t.reshape(B, T, key_heads, dk).repeat_interleave(rep, -2) for t in (q, k))
        return hybrid.l2norm(q), hybrid.l2norm(k), v.reshape(B, T, heads, dv)

    results = []
    for fn in (lambda m: delta_native.deltanet_heads(m, key_heads, heads, dk, dv), torch_heads):
        m = mixed.clone().requires_grad_()
        out = fn(m)
        assert out is not None
        sum((o * u).sum() for o, u in zip(out, upstream, strict=True)).backward()  # type: ignore[union-attr]
        results.append(([o.detach() for o in out], m.grad))
    (got, got_grad), (want, want_grad) = results
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert got[0].transpose(1, 2).is_contiguous()  # heads-major underneath: the rule's layout
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


def test_the_heads_leave_what_they_cannot_take_to_torch() -> None:
    mixed = torch.randn(2, 5, 2 * 2 * 8 + 4 * 8)
    assert delta_native.deltanet_heads(mixed.double(), 2, 4, 8, 8) is None
    assert delta_native.deltanet_heads(mixed[:, :, :-8], 2, 4, 8, 8) is None  # widths
    assert delta_native.deltanet_heads(mixed.transpose(0, 1), 2, 4, 8, 8) is None  # strides
    assert delta_native.deltanet_heads(torch.randn(2, 5, 2 * 2 * 8 + 3 * 8), 2, 3, 8, 8) is None
