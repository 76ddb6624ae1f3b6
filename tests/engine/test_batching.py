"""Continuous batching of decode steps (issue 11 goal 4): a request's samples are
bit-identical alone or decoded beside any other requests, on either GEMM path."""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.engine._hybrid import tiny_hybrid_model
from tinker_sr.engine import batching, gemm
from tinker_sr.engine.batching import CHUNK, decode_step, gemm_mode, padded_rows
from tinker_sr.engine.model import BUILTIN_CONFIGS, Transformer, build_model
from tinker_sr.engine.sampler import DecodeGroup, SampleOutput, generate
from tinker_sr.tokenization.hf import byte_token_table


@pytest.fixture(scope="module")
def model() -> Transformer:
    return build_model("tinker-sr/tiny", seed=3).eval()


@pytest.fixture(scope="module")
def moe_model() -> Transformer:
    """The tiny model with Qwen3-MoE's feed-forward in its second layer (2 of 8 experts): each
    expert's GEMM sees only the rows routed to it, so its row count changes with the batch."""
    config = dataclasses.replace(
        BUILTIN_CONFIGS["tinker-sr/tiny"],
        name="tiny-moe", n_experts=8, experts_per_token=2, moe_ffn_dim=32,
        norm_topk_prob=True, moe_layers=(1,),
    )  # fmt: skip
    return build_model(config, seed=3).eval()


@pytest.fixture(scope="module")
def gpt_oss_model() -> Transformer:
    """The tiny model as gpt-oss: attention sinks, a 6-position window in its first layer,
    biased q/k/v/o, experts with biases and the clamped SwiGLU behind a biased router, YaRN."""
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16}
    config = dataclasses.replace(
        BUILTIN_CONFIGS["tinker-sr/tiny"],
        name="tiny-gpt-oss", n_experts=8, experts_per_token=2, moe_ffn_dim=32,
        moe_layers=(0, 1), gpt_oss=True, layer_types=("sliding_attention", "full_attention"),
        sliding_window=6, attention_bias=True, attention_out_bias=True,
        rope_scaling=tuple(sorted(yarn.items())),
    )  # fmt: skip
    model = build_model(config, seed=3).eval()
    with torch.no_grad():  # sinks and biases that matter (build_model zeroes biases)
        gen = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if name.endswith((".bias", ".sinks")):
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "sinks" in name else 0.1))
    return model


@pytest.fixture(scope="module")
def hybrid_model() -> Transformer:
    return tiny_hybrid_model()


@pytest.fixture(scope="module")
def hybrid_moe_model() -> Transformer:
    return tiny_hybrid_model(moe=True)


def requests() -> list[dict[str, Any]]:
    """Different prompts, lengths, row counts, temperatures, filters, stops, draws, top-k."""
    out = []
    for i in range(7):
        out.append(
            dict(
                prompt=list(range(40 + i, 45 + 4 * i)),
                num_samples=1 + (3 * i) % 8,
                max_tokens=5 + 3 * i,
                temperature=(1.0, 0.7, 0.0, 1.3)[i % 4],
                top_k=(-1, 20)[i % 2],
                top_p=(1.0, 0.9, 1.0)[i % 3],
                seed=100 + i,
                stability_k=8 * (i % 2),
                top_k_logprobs=i % 3,
                stop_token_ids=list(range(97, 97 + 6 * i)),
            )
        )
    out[3].update(stop_strings=["e"], token_bytes=byte_token_table())
    return out


def run_together(model: Transformer, reqs: list[dict[str, Any]]) -> tuple[list[Any], list[int]]:
    """Requests join one by one (one per step after the first three) and leave when done."""
    groups = [DecodeGroup(model, **r) for r in reqs]
    waiting, live, rows = list(groups), [], []
    with torch.inference_mode():
        while waiting or live:
            for _ in range(3 if not live else 1):
                if waiting:
                    g = waiting.pop(0)
                    g.prefill()
                    live.append(g)
            live = [g for g in live if not g.finished]
            if not live:
                continue
            rows.append(sum(len(g.active) for g in live))
            for g, logits in zip(live, decode_step(model, live), strict=True):
                g.receive(logits)
    return [g.outputs() for g in groups], rows


def assert_same(a: list[SampleOutput], b: list[SampleOutput]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.tokens, x.logprobs, x.stop_reason) == (y.tokens, y.logprobs, y.stop_reason)
        for name in ("draws", "topk_token_ids", "topk_logprobs"):
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None) == (v is None)
            if u is not None:
                np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("kind", ["dense", "moe", "hybrid", "hybrid_moe", "gpt_oss"])
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_requests_equal_each_request_alone(
    request: pytest.FixtureRequest, kind: str, threads: int
) -> None:
    model = request.getfixturevalue("model" if kind == "dense" else f"{kind}_model")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        reqs = requests()
        alone = [generate(model, **r) for r in reqs]
        together, rows = run_together(model, reqs)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(alone, together, strict=True):
        assert_same(a, b)
    assert max(rows) > max(r["num_samples"] for r in reqs)  # really decoded together
    stops = [o.stop_reason for outs in alone for o in outs]
    assert "stop" in stops and "length" in stops


def test_finished_rows_leave_the_batch(model: Transformer) -> None:
    g = DecodeGroup(
        model,
        [1, 2, 3],
        num_samples=8,
        max_tokens=40,
        temperature=1.5,
        seed=4,
        stop_token_ids=list(range(0, 259, 7)),
    )
    active = []
    with torch.inference_mode():
        g.prefill()
        while not g.finished:
            active.append(len(g.active))
            g.receive(decode_step(model, [g])[0])
    assert active == sorted(active, reverse=True) and active[-1] < active[0] <= 8
    lengths = sorted(len(o.tokens) for o in g.outputs())
    assert lengths[0] < lengths[-1]


def test_forced_chunked_path_gives_the_same_results(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    reqs = requests()
    default, _ = run_together(model, reqs)
    monkeypatch.setenv(batching.FORCE_CHUNKED_ENV, "1")
    chunked, _ = run_together(model, reqs)
    for a, b in zip(default, chunked, strict=True):
        assert_same(a, b)


def test_probe_detects_a_batch_variant_gemm_and_falls_back(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GEMM whose rows change with the row count (as BLAS kernels do) is caught by the
    probe; the slice-by-slice fallback keeps batched results equal to solo ones."""
    real = F.linear

    def variant(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # each row alone: invariant up to the shift below
        y = torch.cat([real(rows[i : i + 1], w, b) for i in range(rows.shape[0])])
        y = y.view(*x.shape[:-1], w.shape[0])
        return y + 1e-3 if rows.shape[0] > CHUNK else y

    monkeypatch.setattr(batching, "_invariant", {})
    monkeypatch.setattr(torch.nn.functional, "linear", variant)
    w = torch.randn(16, 8)
    assert gemm_mode(w, None, CHUNK) == "whole"
    assert gemm_mode(w, None, 2 * CHUNK) == "slices"
    reqs = requests()
    alone = [generate(model, **r) for r in reqs]
    together, _ = run_together(model, reqs)
    for a, b in zip(alone, together, strict=True):
        assert_same(a, b)


def test_a_gemm_whose_rows_depend_on_their_place_runs_row_by_row(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CHUNK-row product whose last rows come out otherwise than its first (MKL's AVX2
    kernel: rows 6 and 7 of 8) fails the probe's place check even at CHUNK rows; decode then
    multiplies row by row, and batched results stay equal to solo ones."""
    real = F.linear

    def by_place(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.cat([real(rows[i : i + 1], w, b) for i in range(rows.shape[0])])
        y[6:] += 1e-3  # rows past the sixth: another kernel, another rounding
        return y.view(*x.shape[:-1], w.shape[0])

    monkeypatch.setattr(batching, "_invariant", {})
    monkeypatch.setattr(batching, "_stackable", {})
    monkeypatch.setattr(torch.nn.functional, "linear", by_place)
    w = torch.randn(16, 8)
    assert gemm_mode(w, None, CHUNK) == "rows"
    assert gemm_mode(w, None, 3 * CHUNK) == "rows"
    reqs = requests()
    alone = [generate(model, **r) for r in reqs]
    together, _ = run_together(model, reqs)
    for a, b in zip(alone, together, strict=True):
        assert_same(a, b)


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="MKL's AVX2 path: x86 only"
)
def test_batched_equals_alone_with_mkls_avx2_kernels() -> None:
    """The same check, in a process whose MKL runs its AVX2 kernels (as on an AVX2-only CPU;
    `MKL_ENABLE_INSTRUCTIONS` caps it on any x86 CPU): they are not row-invariant at 8 rows."""
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    test = f"{__file__}::test_batched_requests_equal_each_request_alone"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_padded_rows() -> None:
    assert [padded_rows(m) for m in (1, 7, 8, 9, 17, 256)] == [8, 8, 8, 16, 24, 256]


def _count_stacked(monkeypatch: pytest.MonkeyPatch, shift: float = 0.0) -> list[int]:
    """Count `gemm.stacked_linear`'s results in decode (``shift`` added to them: a stacked
    product that rounds differently from the separate ones)."""
    real = gemm.stacked_linear
    used: list[int] = []

    def counted(x: torch.Tensor, ws: list[torch.Tensor], rows: int) -> torch.Tensor | None:
        y = real(x, ws, rows)
        if y is not None:
            used.append(len(ws))
            y = y + shift
        return y

    monkeypatch.setattr(batching, "stacked_linear", counted)
    monkeypatch.setattr(batching, "_stackable", {})
    monkeypatch.setattr(batching, "_invariant", {})
    monkeypatch.setattr(gemm, "MIN_MACS", 1)  # the tiny model's products go through oneDNN
    return used


@pytest.mark.skipif(not gemm.onednn_fp32(), reason="no usable oneDNN float32 GEMM")
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_stacked_projections_give_the_separate_products_results(
    kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k/v and gate/up (Qwen3.5's DeltaNet layers: q/k/v and z) run as one product each
    where the probe finds the same values, and every request's samples stay those of the
    separate products, alone and batched."""
    model = request.getfixturevalue("model" if kind == "dense" else "hybrid_model")
    reqs = requests()
    used = _count_stacked(monkeypatch)
    stacked_alone = [generate(model, **r) for r in reqs]
    stacked_together, _ = run_together(model, reqs)
    assert {3, 2} <= set(used) and (kind == "dense" or 4 in used)
    monkeypatch.setattr(batching, "stacked_linear", lambda *args: None)
    separate = [generate(model, **r) for r in reqs]
    for a, b, c in zip(stacked_alone, stacked_together, separate, strict=True):
        assert_same(a, c)
        assert_same(b, c)


@pytest.mark.skipif(not gemm.onednn_fp32(), reason="no usable oneDNN float32 GEMM")
def test_a_stacked_product_that_rounds_differently_is_not_used(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    reqs = requests()[:3]
    monkeypatch.setattr(gemm, "MIN_MACS", 1)
    monkeypatch.setattr(batching, "stacked_linear", lambda *args: None)
    separate = [generate(model, **r) for r in reqs]
    used = _count_stacked(monkeypatch, shift=1e-3)
    got = [generate(model, **r) for r in reqs]
    assert used and not any(batching._stackable.values())  # probed, refused everywhere
    for a, b in zip(got, separate, strict=True):
        assert_same(a, b)
