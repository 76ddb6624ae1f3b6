"""`engine.prompt_cache`: a prompt prefilled once serves every later request for it, with the
results of a prefill of its own, bit for bit."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import torch

from tests.engine._hybrid import tiny_hybrid_model
from tinker_sr.engine.batching import decode_step
from tinker_sr.engine.model import Transformer, build_model
from tinker_sr.engine.prompt_cache import BUDGET_ENV, PromptCache, budget_from_env
from tinker_sr.engine.sampler import DecodeGroup, SampleOutput

PROMPT = list(range(40, 140))
OPTIONS: dict[str, Any] = dict(
    num_samples=3, max_tokens=12, top_p=0.9, stability_k=4, top_k_logprobs=3, seed=5
)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return build_model("tinker-sr/tiny", seed=3).eval()


@pytest.fixture(scope="module")
def hybrid_model() -> Transformer:
    return tiny_hybrid_model()


def decode(
    model: Transformer, cache: PromptCache | None, prompt: list[int] = PROMPT, **options: Any
) -> tuple[list[SampleOutput], int]:
    group = DecodeGroup(model, prompt, **{**OPTIONS, **options})
    group.prefill(cache)
    with torch.inference_mode():
        while not group.finished:
            group.receive(decode_step(model, [group])[0])
    return group.outputs(), group.cache_hit_tokens


def same(a: list[SampleOutput], b: list[SampleOutput]) -> bool:
    return all(
        x.tokens == y.tokens
        and np.array_equal(np.asarray(x.logprobs), np.asarray(y.logprobs))
        and np.array_equal(np.asarray(x.draws), np.asarray(y.draws))
        and np.array_equal(np.asarray(x.topk_token_ids), np.asarray(y.topk_token_ids))
        and np.array_equal(np.asarray(x.topk_logprobs), np.asarray(y.topk_logprobs))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_hit_gives_a_misses_tokens_logprobs_draws_and_top_k(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """Hybrid (Qwen3.5): the linear-attention layers' convolution windows and recurrent
    states are cached beside the full-attention layers' keys and values."""
    model = request.getfixturevalue("model" if kind == "dense" else "hybrid_model")
    alone, hit_tokens = decode(model, None)
    cache = PromptCache(64 << 20)
    miss, miss_tokens = decode(model, cache)
    hit, hit_tokens = decode(model, cache)
    assert (miss_tokens, hit_tokens) == (0, len(PROMPT))
    assert same(alone, miss) and same(alone, hit)
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)
    # Another seed on the cached prompt: its own rows, still as if prefilled alone.
    other, n = decode(model, cache, seed=6)
    assert n == len(PROMPT) and same(other, decode(model, None, seed=6)[0])
    assert not same(other, alone)


def test_prefill_logits_are_the_forwards_last_position(model: Transformer) -> None:
    tokens = torch.tensor([PROMPT])
    with torch.inference_mode():
        full = model(tokens)[:, -1]
        last = model.last_logits(tokens)
    assert last.shape == full.shape and last.dtype == torch.float32
    torch.testing.assert_close(last, full, atol=1e-5, rtol=1e-5)


def test_entries_belong_to_one_model_and_die_with_it(model: Transformer) -> None:
    cache = PromptCache(64 << 20)
    other = build_model("tinker-sr/tiny", seed=4).eval()
    decode(other, cache)
    assert decode(model, cache)[1] == 0  # same prompt, another model: a miss
    assert decode(other, cache)[1] == len(PROMPT)
    before = cache.nbytes
    del other
    gc.collect()
    decode(model, cache, prompt=PROMPT[:50])  # a put drops the dead model's entries
    assert len(cache) == 2 and cache.nbytes < before  # the dead model's entry is gone


def test_budget_evicts_least_recently_used_and_skips_huge_prompts(model: Transformer) -> None:
    one = PromptCache(64 << 20)
    decode(model, one)
    size = one.nbytes
    cache = PromptCache(4 * size + 1)  # room for four prompts like PROMPT
    prompts = [[p + i for p in PROMPT] for i in range(5)]
    for p in prompts[:4]:
        decode(model, cache, prompt=p)
    decode(model, cache, prompt=prompts[0])  # used again: now the most recent
    decode(model, cache, prompt=prompts[4])  # evicts prompts[1], the least recent
    assert len(cache) == 4 and cache.nbytes <= cache.budget
    assert decode(model, cache, prompt=prompts[0])[1] == len(PROMPT)
    assert decode(model, cache, prompt=prompts[1])[1] == 0
    small = PromptCache(4 * size - 4)  # a prompt of more than a quarter is not kept
    decode(model, small)
    assert len(small) == 0 and decode(model, small)[1] == 0
    off = PromptCache(0)
    decode(model, off)
    assert len(off) == 0 and decode(model, off)[1] == 0


def test_budget_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert budget_from_env() == 256 << 20
    monkeypatch.setenv(BUDGET_ENV, "0")
    assert budget_from_env() == 0
    for bad in ("-1", "lots", "1.5"):
        monkeypatch.setenv(BUDGET_ENV, bad)
        with pytest.raises(ValueError, match=BUDGET_ENV):
            budget_from_env()


# ---- prompts that extend cached ones (multi-turn) ------------------------------------------


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Blocks of 64 tokens, so the tiny model's 512 positions hold prompts of several."""
    from tinker_sr.engine import prompt_cache

    monkeypatch.setattr(prompt_cache, "BLOCK", 64)
    return 64


def turns(n: int, first: int = 150, step: int = 70) -> list[list[int]]:
    """A conversation's prompts: each is the one before plus a reply and the next message."""
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(3, 250, (first + step * (n - 1),), generator=gen).tolist()
    return [tokens[: first + step * t] for t in range(n)]


@pytest.mark.parametrize("block", ["small_blocks", "default_block"])
def test_a_prompt_that_extends_a_cached_one_computes_only_the_rest(
    model: Transformer, request: pytest.FixtureRequest, block: str
) -> None:
    """Each turn copies the blocks the turns before it computed and gives what a prefill of
    its own gives, bit for bit, with other sample counts and lengths (other KV buffers)."""
    size = request.getfixturevalue(block) if block == "small_blocks" else 256
    cache = PromptCache(64 << 20)
    prompts = turns(5)
    for t, prompt in enumerate(prompts):
        options = dict(num_samples=1 + t % 3, max_tokens=5 + t)
        alone, none = decode(model, None, prompt, **options)
        got, hit = decode(model, cache, prompt, **options)
        assert none == 0 and same(got, alone), t
        cached = ((len(prompts[t - 1]) - 1) // size) * size if t else 0
        # The blocks of the turn before are found (those of earlier turns are among them).
        assert hit == min(cached, ((len(prompt) - 1) // size) * size), (t, hit)
        assert decode(model, cache, prompt, **options)[1] == len(prompt)  # now found whole
    assert cache.block_hits > 0


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_chunked_prefill_computes_the_forwards_log_probabilities(
    request: pytest.FixtureRequest, small_blocks: int, kind: str
) -> None:
    """Blocks at their positions over the cache's earlier ones (and, for linear attention,
    from the states the block before left): the sampled tokens' logprobs are those of one
    forward over prompt + sample (float32 rounding apart)."""
    model = request.getfixturevalue("model" if kind == "dense" else "hybrid_model")
    prompt = turns(1, first=300)[0]
    (out,), _ = decode(
        model, PromptCache(64 << 20), prompt, num_samples=1, max_tokens=20, top_p=1.0
    )
    seq = torch.tensor([prompt + out.tokens])
    with torch.inference_mode():
        logp = torch.log_softmax(model(seq)[0, len(prompt) - 1 : -1].float(), -1)
    want = logp.gather(-1, torch.tensor(out.tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_each_turn_resumes_where_the_turn_before_left(
    request: pytest.FixtureRequest, small_blocks: int, kind: str
) -> None:
    """Qwen3.5's linear attention carries a state through the prompt: a turn resumes from the
    states kept after the last full block the turn before computed (intermediate blocks keep
    only keys and values), bit for bit as a prefill of its own."""
    model = request.getfixturevalue("model" if kind == "dense" else "hybrid_model")
    cache = PromptCache(64 << 20)
    prompts = turns(4, first=150, step=90)
    for t, prompt in enumerate(prompts):
        alone, _ = decode(model, None, prompt)
        got, hit = decode(model, cache, prompt)
        assert same(got, alone), t
        resumed = ((len(prompts[t - 1]) - 1) // small_blocks) * small_blocks if t else 0
        assert hit == resumed, (t, hit)
    # A prompt that branches off inside the conversation, after block 3 (which turn 2 computed
    # before its last, block 4): a dense model reuses all four common blocks; a hybrid one the
    # first three, up to block 2, the last full block of turn 1, which kept its states.
    branch = prompts[-1][: 4 * small_blocks + 5] + [7] * 40
    got, hit = decode(model, cache, branch)
    assert same(got, decode(model, None, branch)[0])
    assert hit == (4 if kind == "dense" else 3) * small_blocks, hit
    # The branch computed block 3 again (the hybrid model, to keep states after it): the
    # blocks after it are still found, and the conversation goes on from its last turn.
    longer = prompts[-1] + [9] * 50
    got, hit = decode(model, cache, longer)
    assert same(got, decode(model, None, longer)[0])
    assert hit == ((len(prompts[-1]) - 1) // small_blocks) * small_blocks, hit
