"""The CUDA-graph decode step (`engine.cuda_graphs`): its fixed-shape step computes what eager
decode computes, on the CPU (every machine) and, captured and replayed, on a GPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tinker_sr.engine import cuda_graphs
from tinker_sr.engine.batching import decode_step
from tinker_sr.engine.model import BUILTIN_CONFIGS, Transformer, build_model
from tinker_sr.engine.sampler import DecodeGroup, decode_alone, generate

from ._hybrid import tiny_hybrid_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY = BUILTIN_CONFIGS["tinker-sr/tiny"]
MODELS = [
    pytest.param(lambda: build_model(TINY, seed=3), id="qwen3"),
    pytest.param(tiny_hybrid_model, id="qwen3_5-hybrid"),
]


def _groups(model: Transformer, stops: list[int]) -> list[DecodeGroup]:
    """Two requests of different prompts and row counts; ``stops`` ends rows early."""
    prompts = [[1, 5, 9, 13, 200, 7], [3, 4, 250, 11]]
    return [
        DecodeGroup(model, p, num_samples=n, max_tokens=12, seed=s, stop_token_ids=stops)
        for p, n, s in zip(prompts, (3, 2), (7, 8), strict=True)
    ]


@pytest.mark.parametrize("make", MODELS)
@torch.inference_mode()
def test_the_fixed_shape_step_gives_eager_decodes_logits(make: Callable[[], Transformer]) -> None:
    """Two copies of the same two requests, one decoded by `decode_step`, one by
    `static_step` (all rows, whole caches masked, positions from tensors); both fed the eager
    logits, so they sample the same tokens and rows stop at the same steps (stop ids cover a
    fifth of the vocabulary), and each step's logits of the running rows agree."""
    model = make()
    stops = list(range(0, model.config.vocab_size, 5))
    eager, fixed = _groups(model, stops), _groups(model, stops)
    for g in eager + fixed:
        g.prefill()
    steps = stopped = 0
    while not all(g.finished for g in eager):
        running = [i for i, g in enumerate(eager) if not g.finished]
        want = decode_step(model, [eager[i] for i in running])
        rows = [fixed[i] for i in running]
        inputs = cuda_graphs.StaticInputs.allocate(model, rows)
        inputs.fill(model, rows)
        got = cuda_graphs._per_group(cuda_graphs.static_step(model, rows, inputs), rows, inputs)
        for i, w, g in zip(running, want, got, strict=True):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)
            stopped += int(len(eager[i].active) < eager[i].rows)
            eager[i].receive(w)
            fixed[i].receive(w)
        steps += 1
    assert steps >= 3 and stopped >= 1  # some steps ran with stopped rows
    for a, b in zip(eager, fixed, strict=True):
        assert [o.tokens for o in a.outputs()] == [o.tokens for o in b.outputs()]


def test_graphs_are_for_cuda_models_without_experts_or_sinks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = build_model("tinker-sr/tiny")
    assert not cuda_graphs.graphable(model)  # a CPU model decodes eagerly
    monkeypatch.setattr(Transformer, "device", property(lambda self: torch.device("cuda")))
    assert cuda_graphs.graphable(model)
    monkeypatch.setenv(cuda_graphs.GRAPHS_ENV, "0")
    assert not cuda_graphs.graphable(model)
    monkeypatch.delenv(cuda_graphs.GRAPHS_ENV)
    moe = dataclasses.replace(
        TINY, n_experts=4, experts_per_token=2, moe_ffn_dim=32, moe_layers=(1,)
    )
    assert not cuda_graphs.graphable(build_model(moe))
    windowed = dataclasses.replace(
        TINY, layer_types=("sliding_attention", "full_attention"), sliding_window=6
    )
    assert not cuda_graphs.graphable(build_model(windowed))
    assert cuda_graphs.graphable(tiny_hybrid_model())  # Qwen3.5's linear attention is captured


def _sample(model: Transformer, prompt: list[int]) -> list[tuple[list[int], list[float]]]:
    outs = generate(model, prompt, num_samples=4, max_tokens=40, seed=11)
    return [(o.tokens, o.logprobs) for o in outs]


@needs_cuda
@pytest.mark.parametrize("make", MODELS)
def test_graphed_decode_on_cuda_replays_what_it_captured(
    make: Callable[[], Transformer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU: a sample whose steps were captured (step 2) and replayed (after) equals the
    same sample run with `static_step` uncaptured, bit for bit, and a second graphed run; and
    is within float tolerance of eager `decode_step` (``TINKER_SR_CUDA_GRAPHS=0``) over the
    tokens both share (at least the first two)."""
    model = make().to("cuda")
    prompt = [1, 5, 9, 13, 200, 7, 42]
    graphed = _sample(model, prompt)
    state = cuda_graphs.graphed(model)
    assert state.failed is None, state.failed
    assert state.captures >= 1 and state.replays >= 30
    assert _sample(model, prompt) == graphed
    monkeypatch.setattr(cuda_graphs, "STABLE_STEPS", 10**9)  # never captured
    replays = state.replays
    assert _sample(model, prompt) == graphed
    assert state.replays == replays
    monkeypatch.setenv(cuda_graphs.GRAPHS_ENV, "0")
    eager = _sample(model, prompt)
    for (tok_g, lp_g), (tok_e, lp_e) in zip(graphed, eager, strict=True):
        same = 0
        while same < min(len(tok_g), len(tok_e)) and tok_g[same] == tok_e[same]:
            same += 1
        assert same >= 2
        np.testing.assert_allclose(lp_g[:same], lp_e[:same], atol=1e-3, rtol=1e-3)


DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", MODELS)
@torch.inference_mode()
def test_a_request_decodes_the_same_alone_and_beside_another(
    make: Callable[[], Transformer], device: str
) -> None:
    """Two requests decoded together (`cuda_graphs.decode`: on a GPU one captured set, then
    another when the shorter one leaves) give each the very samples it gets alone."""
    model = make().to(device)
    stops = list(range(0, model.config.vocab_size, 7))
    alone = [decode_alone(g) for g in _groups(model, stops)]
    together = _groups(model, stops)
    for g in together:
        g.prefill()
    while running := [g for g in together if not g.finished]:
        for g, logits in zip(running, cuda_graphs.decode(model, running), strict=True):
            g.receive(logits)
    for a, t in zip(alone, together, strict=True):
        assert [(o.tokens, o.logprobs) for o in a] == [(o.tokens, o.logprobs) for o in t.outputs()]
    if device == "cuda":
        assert cuda_graphs.graphed(model).replays > 0
