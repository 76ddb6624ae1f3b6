"""The batched unit lower triangular solve of Qwen3.5's chunked gated delta rule
(`engine.tri_solve`, ``csrc/tri_solve.c``): torch's solve in values and gradients, float32 and
float64, the same bits at any thread count, and torch's own solve where the C kernels are off."""

from __future__ import annotations

import pytest
import torch

from tinker_sr.engine import compiled, tri_solve


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


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_the_c_solve_is_torchs_in_values_and_gradients(dtype: torch.dtype, tol: float) -> None:
    if tri_solve._library() is None:
        pytest.skip("no C compiler: torch's solve runs")
    system, rhs = _operands(dtype)
    assert tri_solve.native_solve_ready(system, rhs)
    weights = torch.randn(rhs.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ours = _solve_and_grads(tri_solve.unit_lower_solve, system, rhs, weights)
    theirs = _solve_and_grads(_torch_solve, system, rhs, weights)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert torch.equal(ours[1].triu(), torch.zeros_like(ours[1]))  # the diagonal is not read


def test_only_the_inputs_that_need_a_gradient_get_one() -> None:
    system, rhs = _operands(torch.float32)
    for needs in ((True, False), (False, True)):
        a, b = system.clone().requires_grad_(needs[0]), rhs.clone().requires_grad_(needs[1])
        tri_solve.unit_lower_solve(a, b).sum().backward()
        assert (a.grad is not None, b.grad is not None) == needs


def test_the_same_bits_at_any_thread_count() -> None:
    system, rhs = _operands(torch.float32, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tri_solve.unit_lower_solve(system, rhs)
        torch.set_num_threads(max(2, threads))
        many = tri_solve.unit_lower_solve(system, rhs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_torchs_solve_runs_where_the_c_kernels_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "native_mode", lambda: "off")
    system, rhs = _operands(torch.float32)
    assert not tri_solve.native_solve_ready(system, rhs)
    out = tri_solve.unit_lower_solve(system.requires_grad_(), rhs)
    assert type(out.grad_fn).__name__.startswith("LinalgSolveTriangular")
    assert torch.equal(out, _torch_solve(system, rhs))
