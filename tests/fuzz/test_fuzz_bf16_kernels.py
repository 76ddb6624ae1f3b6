"""Fuzz the bf16 C kernels (`engine.bf16_rows`) over shapes and values: row lengths with and
without a vector tail, few and many rows, large, tiny and subnormal magnitudes, infinities.
Each either declines (None: the caller runs torch's ops) or gives what it promises: the
residual norm and the loss's softmax the very bits of the float32 path on widened operands,
the SwiGLU and causal softmax within one bf16 place of torch's bf16 ops, NaN where torch has
NaN; never a crash, never a result for operands it does not take."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ
from tinker_sr.engine import bf16_rows, compiled, fused, native

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None and shutil.which("clang") is None,
    reason="the C kernels need a C compiler",
)

SCALES = st.sampled_from([1e-38, 1e-20, 1e-3, 1.0, 30.0, 1e4, 3e38])


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv(native.CACHE_ENV, str(tmp_path_factory.mktemp("kernels")))
    for cached in (native.load, bf16_rows._library, compiled._rows_library):
        cached.cache_clear()
    yield
    mp.undo()
    for cached in (native.load, bf16_rows._library, compiled._rows_library):
        cached.cache_clear()


def _values(seed: int, shape: tuple[int, ...], scale: float, specials: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * scale
    if specials and x.numel() > 3:
        flat = x.view(-1)
        flat[0], flat[1], flat[2] = float("inf"), -float("inf"), 1e-40
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN where NaN (a kernel's NaN need not have torch's payload)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan())) and bool(torch.equal(a[~nan], b[~nan]))


def _places(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in b's last bf16 place, over the entries both have finite, counting
    differences under 1e-30 as none: where a gate is below about -88 torch's exp overflows to
    inf (silu -> -0) while the kernels' exp clamps (silu ~ -1e-37): both numerically zero."""
    both = a.float().isfinite() & b.float().isfinite()
    a32, b32 = a.float()[both], b.float()[both]
    unit = torch.ldexp(torch.ones_like(b32), torch.frexp(b32).exponent - 8).clamp_min(2.0**-133)
    diff = (a32 - b32).abs()
    diff = torch.where(diff < 1e-30, torch.zeros_like(diff), diff)
    return float((diff / unit).max()) if a32.numel() else 0.0


@FUZZ
@given(
    rows=st.integers(1, 300),
    n=st.integers(1, 70).map(lambda k: 16 * k),
    extra=st.sampled_from([0, 0, 1, 7, 15]),
    scale=SCALES,
    seed=st.integers(0, 2**16),
    specials=st.booleans(),
)
def test_residual_norm_gives_the_float32_bits(
    rows: int, n: int, extra: int, scale: float, seed: int, specials: bool
) -> None:
    width = n + extra  # a vector tail where extra > 0
    x0 = _values(seed, (rows, width), scale, specials)
    y0 = _values(seed + 1, (rows, width), scale, False).bfloat16()
    w = _values(seed + 2, (width,), 1.0, False)
    g_out = _values(seed + 3, (rows, width), 1.0, False).bfloat16()
    g_h = _values(seed + 4, (rows, width), 1.0, False)

    def run(low_out: bool) -> list[torch.Tensor] | None:
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h, out = fused.add_rms_norm(x, y, w, 1e-6, low_out=low_out)
            if low_out and out.dtype != torch.bfloat16:
                return None  # declined (small or otherwise not taken): torch's path ran
            out = out.to(torch.bfloat16)
        torch.autograd.backward([h, out], [g_h, g_out])
        assert x.grad is not None and y.grad is not None
        return [h.detach(), out.detach(), x.grad, y.grad]

    got, want = run(True), run(False)
    assert want is not None
    if got is None:
        assert rows * width < compiled.MIN_ELEMENTS
        return
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and _same(a, b)


@FUZZ
@given(
    rows=st.integers(1, 40),
    vocab=st.integers(1, 400).map(lambda k: 16 * k),
    ragged=st.booleans(),
    scale=SCALES,
    seed=st.integers(0, 2**16),
)
def test_loss_softmax_gives_the_float32_kernels_bits(
    rows: int, vocab: int, ragged: bool, scale: float, seed: int
) -> None:
    v = vocab + (3 if ragged else 0)
    z0 = _values(seed, (rows, v), scale, False).bfloat16()
    lse = torch.empty(rows)
    z = z0.clone()
    total = bf16_rows.softmax_rows(z, lse)
    if ragged or rows * v < compiled.MIN_ELEMENTS:
        assert total is None and torch.equal(z, z0)  # declined, untouched
        return
    assert total is not None
    wide, lse_ref = z0.float(), torch.empty(rows)
    total_ref = compiled.softmax_rows(wide, lse_ref)
    assert total_ref is not None
    assert _same(lse, lse_ref) and _same(total, total_ref) and _same(z, wide.bfloat16())


@FUZZ
@given(
    rows=st.integers(1, 200),
    f=st.integers(1, 200).map(lambda k: 16 * k),
    scale=SCALES,
    seed=st.integers(0, 2**16),
)
def test_swiglu_within_a_place_of_torch(rows: int, f: int, scale: float, seed: int) -> None:
    gate_up = _values(seed, (rows, 2 * f), scale, False).bfloat16()
    dh = _values(seed + 1, (rows, f), 1.0, False).bfloat16()
    gate, up = gate_up.chunk(2, -1)
    h = bf16_rows.silu_mul(gate, up)
    if rows * f < compiled.MIN_ELEMENTS:
        assert h is None
        return
    assert h is not None
    assert _places(h, F.silu(gate) * up) <= 1.0
    grads = bf16_rows.swiglu_backward(gate_up.clone(), dh)
    assert grads is not None
    d_gate, d_up = grads.chunk(2, -1)
    assert _places(d_up, F.silu(gate) * dh) <= 1.0
    assert _places(d_gate, torch.ops.aten.silu_backward(dh * up, gate)) <= 1.0


@FUZZ
@given(
    n=st.integers(1, 12),
    g=st.integers(1, 4),
    t=st.integers(1, 40).map(lambda k: 8 * k),
    scale=SCALES,
    seed=st.integers(0, 2**16),
)
def test_causal_softmax_within_a_place_of_torch(
    n: int, g: int, t: int, scale: float, seed: int
) -> None:
    s0 = _values(seed, (n, g * t, t), min(scale, 1e4), False).bfloat16()
    p = bf16_rows.causal_softmax(s0.clone())
    if t % 16 or n * g * t * t < compiled.MIN_ELEMENTS:
        assert p is None
        return
    assert p is not None
    mask = torch.ones(t, t, dtype=torch.bool).triu_(1).repeat(g, 1)
    want = torch.softmax(s0.masked_fill(mask, float("-inf")), dim=-1)
    assert bool((p.masked_select(mask.expand_as(p)) == 0).all())
    assert _places(p, want) <= 1.0


def test_silu_of_extreme_gates_is_torchs() -> None:
    """A gate under about -88.7 makes exp(-gate) overflow: silu is then -0, as torch's. The
    kernels' exp once clamped its input at 88.38 instead, so silu(-3e38) came out as -1.4 (and
    the float32 kernel's sigmoid as 4e-39) instead of 0."""
    gates = torch.tensor([-3e38, -1e30, -100.0, -88.8, -80.0, 0.0, 80.0, 1e30, 3e38])
    gate = gates.repeat(8192, 1)
    up = torch.full_like(gate, 2.0)
    want = F.silu(gate) * up
    got32 = compiled.call_native("silu_mul", gate, up)
    assert got32 is not None and torch.equal(got32[:, :4], want[:, :4])
    torch.testing.assert_close(got32, want, rtol=1e-6, atol=0.0)
    got16 = bf16_rows.silu_mul(gate.bfloat16().contiguous(), up.bfloat16())
    assert got16 is None  # 9 columns: not a multiple of 16, declined
    wide = gate.repeat(1, 16)[:, :144].bfloat16().contiguous()
    h = bf16_rows.silu_mul(wide, torch.full_like(wide, 2.0))
    assert h is not None
    assert _places(h, F.silu(wide) * 2.0) <= 1.0 and bool((h[:, 0] == 0).all())
