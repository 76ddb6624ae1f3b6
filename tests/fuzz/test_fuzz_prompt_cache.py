"""Property: whatever the prompt cache holds (prompts that extend, branch off or repeat earlier
ones; a budget that evicts blocks mid-conversation, or none), a request samples exactly what a
prefill of its own gives, and reports as cached only whole blocks or the whole prompt; on a
dense model and on a hybrid one (Qwen3.5's linear attention, which resumes from kept states)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.engine._hybrid import tiny_hybrid_model
from tests.engine.test_prompt_cache import decode, same
from tests.fuzz.conftest import FUZZ
from tinker_sr.engine import prompt_cache
from tinker_sr.engine.model import Transformer, build_model
from tinker_sr.engine.prompt_cache import PromptCache

BLOCK = 4  # small: the short prompts hypothesis tends to draw hold several blocks


@pytest.fixture(scope="module")
def models() -> dict[str, Transformer]:
    return {"dense": build_model("tinker-sr/tiny", seed=3).eval(), "hybrid": tiny_hybrid_model()}


# A request: the prompt of an earlier request (by index, modulo how many there are; or none),
# cut at a fraction of its length, plus new tokens; then its sampling options.
requests = st.lists(
    st.tuples(
        st.one_of(st.none(), st.integers(0, 7)),
        st.floats(0.0, 1.0),
        st.lists(st.integers(3, 249), min_size=0, max_size=40),
        st.integers(1, 3),
        st.integers(1, 6),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=6,
)


@FUZZ
@given(
    kind=st.sampled_from(["dense", "hybrid"]),
    budget=st.sampled_from([0, 30_000, 200_000, 64 << 20]),
    plan=requests,
)
def test_any_cache_state_gives_a_prefill_of_its_own(
    models: dict[str, Transformer],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    budget: int,
    plan: list[Any],
) -> None:
    monkeypatch.setattr(prompt_cache, "BLOCK", BLOCK)
    model = models[kind]
    cache = PromptCache(budget)
    prompts: list[list[int]] = []
    for i, (parent, cut, new, samples, max_tokens, seed) in enumerate(plan):
        head = prompts[parent % len(prompts)] if parent is not None and prompts else []
        # A token of its own first: the prompt leaves its parent's exactly at the cut.
        prompt = head[: round(cut * len(head))] + [250 + i] + new
        prompts.append(prompt)
        options = dict(num_samples=samples, max_tokens=max_tokens, seed=seed)
        got, hit = decode(model, cache, prompt, **options)
        alone, _ = decode(model, None, prompt, **options)
        assert same(got, alone), (prompt, options)
        assert hit == len(prompt) or (hit % BLOCK == 0 and hit < len(prompt)), hit
        assert budget or hit == 0
        assert cache.nbytes <= cache.budget
