"""Sampling: one prefill, then all samples of a request decode as one batch over a KV cache.

The sampling distribution at each step is

    q = softmax(filter(logits / temperature))

where `filter` keeps the top_k largest logits (top_k = -1: all), then the smallest set of the
most likely remaining tokens whose renormalised mass reaches top_p, and sets the rest to -inf.
Every output of `generate` refers to this one q:

- the token is drawn from q by inverse CDF with a uniform from the row's "token" stream;
- `logprobs[t]` = log q(token), i.e. the log-probability under the distribution the token was
  actually drawn from (post temperature and filters), not under the raw model. This is what an
  importance ratio or StableReinforce's KL term needs: the sampler's own density;
- the K stability draws are i.i.d. from the same q, with replacement, by inverse CDF on
  uniforms from the row's independent "draws" stream (never the token's uniform).

temperature == 0 is greedy: q is a point mass on the argmax, logprobs are 0.0 and every
draw equals the chosen token. So is any temperature below GREEDY_BELOW_TEMPERATURE: that is
the limit of q as the temperature falls to 0, and dividing logits by a smaller number would
overflow float32 to inf and make q NaN. top_p always keeps the most likely token, however
small top_p is. The OpenAI-compatible routes may ask for other log-probs and top-k
(``logprobs_mode``, vLLM's two modes): "processed_logprobs" reports q but a greedy row's the
model's own, log_softmax(logits); "raw_logprobs" the model's own at every temperature. Tokens
and draws are the same in every mode.

Randomness is counter-based: row i of a request with seed s uses generators seeded from
hash(s, i, "token") and hash(s, i, "draws"), so the same seed gives bit-identical tokens,
logprobs and draws, rows differ from each other, and a row's uniforms do not depend on how
many samples were requested. All uniforms are drawn once, before decoding starts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch import Tensor

from tinker_sr.engine import prompt_cache as blocks
from tinker_sr.engine.cuda_graphs import decode
from tinker_sr.engine.fused import apply_linear
from tinker_sr.engine.loss_logprobs import chunk_rows
from tinker_sr.engine.model import KVCache, Transformer, _stable_seed
from tinker_sr.engine.prompt_cache import ROOT, CachedPrompt, PromptCache
from tinker_sr.engine.stops import StopStrings
from tinker_sr.user_errors import EngineUserError

TOPK_SENTINEL = (0, -99999.0)  # empty top-k cell, as in tinker's TopkLogprobs
GREEDY_BELOW_TEMPERATURE = 1e-6  # temperatures below this sample greedily (module docstring)
# What a sample's log-probs and top-k report (module docstring): the Tinker API's q, or vLLM's
# two modes (the OpenAI-compatible routes).
LogprobsMode = Literal["sampled", "processed_logprobs", "raw_logprobs"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]  # log q(token) under the sampling distribution q (module docstring)
    stop_reason: Literal["length", "stop"]
    draws: np.ndarray | None = None  # int32 [len(tokens), K] stability draws from q
    topk_token_ids: np.ndarray | None = None  # int32 [len(tokens), k] top of q, best first
    topk_logprobs: np.ndarray | None = None  # float32 [len(tokens), k]; sentinel past q's support


@dataclass
class NewTokens:
    """A row's tokens sampled since the last report (`DecodeGroup.new_tokens`), with what
    `SampleOutput` will hold of them: log q of each (float32; the model's log p where
    ``logprobs_mode`` says: module docstring) and, where the request asked for top-k
    log-probs, the top of that distribution at each (``None`` otherwise; sentinels past its
    support)."""

    tokens: list[int]
    logprobs: np.ndarray
    topk_token_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None


def _row_generator(seed: int, row: int, stream: str) -> torch.Generator:
    return torch.Generator().manual_seed(_stable_seed("tinker_sr.sampler", seed, row, stream))


def sampling_logprobs(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """[n, V] raw logits → [n, V] log q (float32; -inf outside the kept set). temperature > 0."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    V = z.shape[-1]
    if 0 < top_k < V:
        vals, idx = z.topk(top_k, dim=-1)  # sorted, descending
    elif top_p < 1.0:
        vals, idx = z.sort(dim=-1, descending=True, stable=True)
    else:
        return z.log_softmax(-1)
    if top_p < 1.0:
        p = vals.softmax(-1)
        before = p.cumsum(-1) - p  # mass strictly ahead of each token
        drop = before >= top_p
        drop[..., 0] = False  # the first is always kept (a tiny top_p rounds to 0 in float32)
        vals = vals.masked_fill(drop, -math.inf)
    kept = torch.full_like(z, -math.inf).scatter_(-1, idx, vals)
    return kept.log_softmax(-1)


def _inverse_cdf(cdf: Tensor, last: Tensor, u: Tensor) -> Tensor:
    """Token ids for uniforms u [n, m] from an unnormalised float64 CDF [n, V]."""
    ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    # u * total can round up to total; `last` is the last token with q > 0.
    return torch.minimum(ids, last[:, None])


def _check_tokens(tokens: Sequence[int], vocab_size: int, field: str) -> None:
    if len(tokens) == 0:
        raise EngineUserError(
            f"{field}: expected at least one token, got none; add a token (e.g. BOS)"
        )
    t = torch.as_tensor(list(tokens))
    bad = ((t < 0) | (t >= vocab_size)).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise EngineUserError(
            f"{field}: token id {int(t[i])} at position {i} is outside the model vocabulary "
            f"[0, {vocab_size}); use ids from this model's tokenizer"
        )


def context_overflow(
    prompt_len: int, max_tokens: int, context: int, sdk_hint: bool = True
) -> str | None:
    """Why a sample of ``max_tokens`` after a ``prompt_len``-token prompt does not fit the
    model's context, in the hosted service's words (tinker-cookbook's capture proxy matches
    them to tell an agent to compact its history); None when it fits. ``sdk_hint`` adds, where
    the prompt fills the context, why the Tinker SDK's compute_logprobs cannot score it (not
    for the OpenAI routes, whose users never call it)."""
    total = prompt_len + max_tokens
    if total <= context:
        return None
    hint = ""
    # compute_logprobs asks for one token, or a sample whose max_tokens is the room left,
    if sdk_hint and max_tokens == 1 and prompt_len == context:  # as None asks
        hint = (
            f" (a sample needs room for one new token after its prompt; compute_logprobs "
            f"samples one too, so it scores at most {context - 1} tokens, where "
            "TrainingClient.forward scores a sequence that fills the context)"
        )
    return (
        f"Prompt length plus max_tokens exceeds the model's context window: {prompt_len} prompt "
        f"tokens + {max_tokens} max_tokens > {context}; cut the prompt or max_tokens by "
        f"{total - context}{hint}"
    )


def _validate(
    model: Transformer,
    prompt: Sequence[int],
    num_samples: int,
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    stop_token_ids: Sequence[int],
    stop_strings: Sequence[str],
    token_bytes: Sequence[bytes] | None,
    stability_k: int,
    top_k_logprobs: int,
) -> None:
    cfg = model.config
    _check_tokens(prompt, cfg.vocab_size, "prompt")
    if num_samples < 1:
        raise EngineUserError(f"num_samples: expected >= 1, got {num_samples}")
    if max_tokens < 1:
        raise EngineUserError(f"max_tokens: expected >= 1, got {max_tokens}")
    overflow = context_overflow(len(prompt), max_tokens, cfg.max_seq_len)
    if overflow is not None:
        raise EngineUserError(overflow)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise EngineUserError(f"temperature: expected a finite number >= 0, got {temperature}")
    if not (0.0 < top_p <= 1.0):
        raise EngineUserError(f"top_p: expected a value in (0, 1], got {top_p}; use 1 for no limit")
    if top_k == 0 or top_k < -1:
        raise EngineUserError(f"top_k: expected -1 (no limit) or >= 1, got {top_k}")
    for i in stop_token_ids:
        if not 0 <= int(i) < cfg.vocab_size:
            raise EngineUserError(
                f"stop: token id {i} is outside the model vocabulary [0, {cfg.vocab_size})"
            )
    if any(not s for s in stop_strings):
        raise EngineUserError("stop: stop strings must be non-empty")
    if stop_strings and token_bytes is None:
        raise EngineUserError(
            "stop: stop strings need token_bytes (the model tokenizer's bytes per token id)"
        )
    if stability_k < 0:
        raise EngineUserError(f"stability_k: expected >= 0, got {stability_k}")
    if top_k_logprobs < 0:
        raise EngineUserError(f"topk_sample_logprobs: expected >= 0, got {top_k_logprobs}")


def generate(model: Transformer, prompt: list[int], **options: Any) -> list[SampleOutput]:
    """Sample continuations of `prompt`, alone (see the module docstring for q); ``options``
    are `DecodeGroup`'s (num_samples, max_tokens, seed, temperature, top_k, top_p, stops,
    stability_k, top_k_logprobs).

    This is one `DecodeGroup` decoded through the same batched decode step
    (`engine.batching`) that decodes it beside other requests, with the same results.
    """
    return decode_alone(DecodeGroup(model, prompt, **options))


@torch.inference_mode()
def decode_alone(group: DecodeGroup) -> list[SampleOutput]:
    """Prefill ``group`` and decode it to the end on its own."""
    group.prefill()
    while not group.finished:
        group.receive(decode(group.model, [group])[0])
    return group.outputs()


class DecodeGroup:
    """The rows of one request (its num_samples continuations of one prompt) on their way
    through decoding: the request's own KV cache, uniforms, stop state and outputs.

    Stops a row when it produces a stop token id (kept in `tokens`, stop_reason "stop"), or
    when the decoded text of its sampled tokens contains a stop string (tokens end with the
    token that completed it, "stop"); otherwise it runs to max_tokens ("length"). Stop strings
    are matched incrementally on `token_bytes[id]`, the model tokenizer's bytes per id (see
    `tinker_sr.engine.stops`). `stability_k` > 0 adds `draws` [T, K]; `top_k_logprobs` > 0
    adds the top entries of log q.

    `prefill` runs the prompt once (batch 1, broadcast to every row's cache) and samples the
    first token; each `receive` takes the next logits of the active rows (from
    `engine.batching.decode_step`, alone or beside other groups) and samples the next token.
    A row that stops leaves `active`; the group is `finished` when every row stopped or
    max_tokens were sampled. Sampling works on all of the group's rows (finished rows keep
    their last logits), so nothing it computes depends on other groups.
    """

    def __init__(
        self,
        model: Transformer,
        prompt: list[int],
        *,
        num_samples: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        token_bytes: Sequence[bytes] | None = None,
        seed: int,
        stability_k: int = 0,
        top_k_logprobs: int = 0,
        logprobs_mode: LogprobsMode = "sampled",
        cache_scope: str = "",
    ) -> None:
        _validate(
            model, prompt, num_samples, max_tokens, temperature, top_k, top_p,
            stop_token_ids, stop_strings, token_bytes, stability_k, top_k_logprobs,
        )  # fmt: skip
        n, K, V = num_samples, stability_k, model.config.vocab_size
        self.model, self.prompt, self.max_tokens = model, list(prompt), max_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.greedy = temperature < GREEDY_BELOW_TEMPERATURE
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {logprobs_mode!r}: one of {LOGPROBS_MODES}")
        self.logprobs_mode = logprobs_mode  # what log-probs report (module docstring)
        self.u_tok, self.u_draw = _uniforms(seed, n, max_tokens, 0 if self.greedy else K)
        kk = min(top_k_logprobs, V)
        self.out_tok = torch.zeros(n, max_tokens, dtype=torch.long)
        self.out_lp = torch.zeros(n, max_tokens, dtype=torch.float32)
        self.out_draws = torch.zeros(n, max_tokens, K, dtype=torch.int32)
        self.out_topk_ids = torch.zeros(n, max_tokens, kk, dtype=torch.int32)
        self.out_topk_lp = torch.zeros(n, max_tokens, kk, dtype=torch.float32)
        self.lengths = torch.full((n,), max_tokens, dtype=torch.long)
        self.done = torch.zeros(n, dtype=torch.bool)
        self.stop_ids = torch.tensor(sorted({int(i) for i in stop_token_ids}), dtype=torch.long)
        self.matcher = (
            StopStrings(stop_strings, token_bytes, n) if stop_strings and token_bytes else None
        )
        self.logits = torch.zeros(n, V)
        self.t = 0  # index of the next token to sample
        self._reported = 0  # tokens `new_tokens` has handed out
        self.pos = len(prompt)  # position of the tokens fed at the next decode step
        self.finished = False
        self.cache_hit_tokens = 0  # prompt tokens `prefill` copied from a PromptCache
        self.cache_scope = cache_scope  # whose cached prompts it may use (a session's)
        self._active = torch.arange(n)
        self._fed = torch.zeros(n, dtype=torch.long)

    cache: KVCache  # allocated by `prefill`

    @property
    def rows(self) -> int:
        return int(self.done.shape[0])

    @property
    def cache_bytes(self) -> int:
        """Bytes of the KV cache `prefill` allocates: keys and values of every row, layer and
        position (prompt + max_tokens), and a hybrid model's recurrent states."""
        positions = len(self.prompt) + self.max_tokens
        return KVCache.nbytes_for(self.model.config, self.rows, positions, self.model.dtype)

    @property
    def active(self) -> Tensor:
        return self._active

    @property
    def fed_tokens(self) -> Tensor:
        return self._fed

    @torch.inference_mode()
    def prefill(self, prompt_cache: PromptCache | None = None) -> None:
        """Allocate the KV cache, run the prompt into every row's cache `BLOCK` tokens at a
        time at fixed positions, and sample the first token. With ``prompt_cache``, the leading
        blocks this model prefilled recently for a prompt this one extends (or the whole
        prompt) are copied from it instead (the same tensors: bit-identical results;
        `engine.prompt_cache`), and what is computed is added to it; `cache_hit_tokens` counts
        the prompt tokens not computed."""
        P, prompt, BLOCK, hybrid = (
            len(self.prompt),
            self.prompt,
            blocks.BLOCK,
            self.model.config.hybrid,
        )
        self.cache = self.model.new_cache(self.rows, P + self.max_tokens)
        n = (P - 1) // BLOCK  # full blocks before the last chunk
        found, tail = (
            ([], None)
            if prompt_cache is None
            else prompt_cache.lookup(self.model, prompt, hybrid=hybrid, scope=self.cache_scope)
        )
        for j, block in enumerate(found):
            self._copy_in(block, j * BLOCK)
        if tail is not None:
            assert tail.logits is not None
            self._copy_in(tail, n * BLOCK)
            self.cache_hit_tokens, last = P, tail.logits
        else:
            self.cache_hit_tokens = len(found) * BLOCK
            tokens = torch.tensor([prompt])
            parent: int | None = found[-1].uid if found else ROOT
            for j in range(len(found), n):
                a, b = j * BLOCK, (j + 1) * BLOCK
                self.model.hidden_states(tokens[:, a:b], start_pos=a, cache=self.cache)
                if prompt_cache is not None and parent is not None:
                    # A hybrid model's states after its last full block: where a prompt that
                    # extends this one resumes (only there: they are large).
                    states = self._states() if j == n - 1 else {}
                    parent = prompt_cache.put(
                        self.model,
                        parent,
                        prompt[a:b],
                        *self._kv(a, b),
                        states=states,
                        scope=self.cache_scope,
                    )
            a = n * BLOCK
            last = self.model.last_logits(tokens[:, a:], start_pos=a, cache=self.cache)
            if prompt_cache is not None and parent is not None:
                kv = self._kv(a, P)
                prompt_cache.put(
                    self.model, parent, prompt[a:], *kv, last, self._states(), self.cache_scope
                )
        self.logits.copy_(last.expand_as(self.logits))
        self._sample()

    def _kv(self, a: int, b: int) -> tuple[list[Tensor], list[Tensor]]:
        """Positions a..b of every layer's keys and values (one row: all rows hold the prompt)."""
        return [k[:1, :, a:b] for k in self.cache.k], [v[:1, :, a:b] for v in self.cache.v]

    def _states(self) -> dict[int, tuple[Tensor, Tensor]]:
        """Each linear-attention layer's convolution window and recurrent state (one row)."""
        return {i: (c[:1], self.cache.state[i][:1]) for i, c in self.cache.conv.items()}

    def _copy_in(self, entry: CachedPrompt, start: int) -> None:
        """An entry's keys and values at `start` into every row, and its states if it has them."""
        for layer, (k, v) in enumerate(zip(entry.k, entry.v, strict=True)):
            self.cache.update(layer, start, k, v)
        for layer, (conv, state) in entry.states.items():  # Qwen3.5's linear attention
            self.cache.conv[layer].copy_(conv.expand_as(self.cache.conv[layer]))
            self.cache.state[layer].copy_(state.expand_as(self.cache.state[layer]))

    @torch.inference_mode()
    def receive(self, logits: Tensor) -> None:
        """The active rows' logits [len(active), V] after the last fed token: sample the next."""
        if len(self._active) == self.rows:
            self.logits.copy_(logits)
        else:
            self.logits[self._active] = logits
        self._sample()

    def _sample(self) -> None:
        t = self.t
        tok = self._draw(t)
        hit = (
            ~self.done & torch.isin(tok, self.stop_ids)
            if len(self.stop_ids)
            else torch.zeros_like(self.done)
        )
        if self.matcher is not None:
            for i, (tok_i, done_i) in enumerate(zip(tok.tolist(), self.done.tolist(), strict=True)):
                if not done_i and self.matcher.push(i, tok_i):
                    hit[i] = True
        self.lengths[hit] = t + 1
        self.done |= hit
        if t + 1 == self.max_tokens or bool(self.done.all()):
            self.finished = True
            return
        self._active = (~self.done).nonzero().squeeze(1)
        self._fed = tok[self._active]
        self.pos = len(self.prompt) + t
        self.t = t + 1

    def _draw(self, t: int) -> Tensor:
        """Token t of every row from q (module docstring), with its log q, draws and top-k."""
        logits = self.logits
        if self.greedy:
            tok = logits.argmax(-1)
            if self.logprobs_mode != "sampled":
                logq = torch.log_softmax(logits.float(), dim=-1)
            else:
                arange_v = torch.arange(logits.shape[-1])
                logq = torch.where(arange_v == tok[:, None], 0.0, -math.inf)
        else:
            logq = sampling_logprobs(logits, self.temperature, self.top_k, self.top_p)
            cdf = logq.exp().double().cumsum_(-1)
            last = cdf.argmax(-1)  # first index reaching the total = last token with q > 0
            tok = _inverse_cdf(cdf, last, self.u_tok[:, t : t + 1]).squeeze(1)
            if self.u_draw is not None:
                self.out_draws[:, t] = _inverse_cdf(cdf, last, self.u_draw[:, t]).to(torch.int32)
        if self.out_draws.shape[2] and self.greedy:
            self.out_draws[:, t] = tok[:, None].to(torch.int32)
        if self.logprobs_mode == "raw_logprobs" and not self.greedy:
            logq = torch.log_softmax(logits.float(), dim=-1)  # reported: the model's, not q's
        self.out_tok[:, t] = tok
        self.out_lp[:, t] = logq.gather(-1, tok[:, None]).squeeze(1)
        if self.greedy:  # a point mass's log q is 0 whatever the logits: NaN where they are not
            top = logits.gather(-1, tok[:, None]).squeeze(1)  # finite (NaN is argmax's max)
            self.out_lp[:, t] = torch.where(torch.isfinite(top), self.out_lp[:, t], math.nan)
        if self.out_topk_ids.shape[2]:
            top_lp, top_ids = logq.topk(self.out_topk_ids.shape[2], dim=-1)
            self.out_topk_ids[:, t] = top_ids.to(torch.int32)
            self.out_topk_lp[:, t] = top_lp
        return tok

    @property
    def sampled(self) -> int:
        """Tokens sampled so far per row (a stopped row's: up to its stop)."""
        return self.t + 1 if self.finished else self.t

    def new_tokens(self) -> list[NewTokens]:
        """Each row's tokens sampled since the last call, a stopped row's up to its stop, with
        their scores (what `outputs` will hold of them): a streaming answer's progress."""
        start, self._reported = self._reported, self.sampled
        ends = (self.lengths.clamp(max=self.sampled) - start).clamp(min=0).tolist()
        rows = self.out_tok[:, start : self.sampled].tolist()
        lps = self.out_lp[:, start : self.sampled].numpy().copy()
        top = None
        if self.out_topk_ids.shape[2]:
            new = slice(start, self.sampled)
            top = _topk_cells(self.out_topk_ids[:, new], self.out_topk_lp[:, new])
        return [
            NewTokens(row[:n], lps[i, :n], *((top[0][i, :n], top[1][i, :n]) if top else ()))
            for i, (row, n) in enumerate(zip(rows, ends, strict=True))
        ]

    def outputs(self) -> list[SampleOutput]:
        return _outputs(
            self.out_tok, self.out_lp, self.out_draws, self.out_topk_ids, self.out_topk_lp,
            self.lengths, self.done,
        )  # fmt: skip


def _uniforms(seed: int, n: int, max_tokens: int, k: int) -> tuple[Tensor, Tensor | None]:
    """Per-row uniforms for the sampled tokens [n, T] and (k > 0) the draws [n, T, k], each
    row from its own stream, so results do not depend on the other rows."""
    u_tok = torch.stack(
        [torch.rand(max_tokens, dtype=torch.float64, generator=_row_generator(seed, i, "token"))
         for i in range(n)]
    )  # fmt: skip
    u_draw = None
    if k:
        u_draw = torch.stack(
            [torch.rand(max_tokens, k, dtype=torch.float64, generator=_row_generator(seed, i, "draws"))
             for i in range(n)]
        )  # fmt: skip
    return u_tok, u_draw


def _topk_cells(ids: Tensor, lps: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids and log-probs as arrays of their own, with `TOPK_SENTINEL` in the cells past
    q's support (log q = -inf)."""
    ids_np, lps_np = ids.numpy().copy(), lps.numpy().copy()
    empty = np.isneginf(lps_np)
    ids_np[empty], lps_np[empty] = TOPK_SENTINEL
    return ids_np, lps_np


def _outputs(
    out_tok: Tensor,
    out_lp: Tensor,
    out_draws: Tensor,
    out_topk_ids: Tensor,
    out_topk_lp: Tensor,
    lengths: Tensor,
    done: Tensor,
) -> list[SampleOutput]:
    """One `SampleOutput` per row, cut to its length."""
    K, kk = out_draws.shape[2], out_topk_ids.shape[2]
    outputs = []
    for i in range(len(lengths)):
        L = int(lengths[i])
        topk_ids = topk_lp = None
        if kk:
            topk_ids, topk_lp = _topk_cells(out_topk_ids[i, :L], out_topk_lp[i, :L])
        outputs.append(
            SampleOutput(
                tokens=out_tok[i, :L].tolist(),
                logprobs=out_lp[i, :L].tolist(),
                stop_reason="stop" if bool(done[i]) else "length",
                draws=out_draws[i, :L].numpy().copy() if K else None,
                topk_token_ids=topk_ids,
                topk_logprobs=topk_lp,
            )
        )
    return outputs


# --- scoring a given sequence ----------------------------------------------------------------


@torch.inference_mode()
def _prompt_rows(model: Transformer, tokens: Sequence[int]) -> Iterator[tuple[slice, Tensor]]:
    """(rows, float32 logits [n, V]) of the raw model after prompt positions ``rows`` of
    0 .. len(tokens) - 2, `chunk_rows(V)` rows at a time: no [T, V] tensor exists (for a
    16k-token prompt and a 152k vocabulary that would be 10 GB, twice with its log-softmax)."""
    _check_tokens(tokens, model.config.vocab_size, "prompt")
    hidden = model.hidden_states(torch.tensor([list(tokens)]))[0, :-1]
    step = chunk_rows(model.config.vocab_size)
    for a in range(0, hidden.shape[0], step):
        rows = slice(a, min(a + step, hidden.shape[0]))
        yield rows, apply_linear(model.lm_head, hidden[rows]).float().cpu()


def score_tokens(model: Transformer, tokens: Sequence[int]) -> np.ndarray:
    """float32 [len(tokens) - 1]: entry t = log p(tokens[t+1] | tokens[:t+1]) under the raw model."""
    targets = torch.tensor(list(tokens[1:]))[:, None]
    out = np.empty(max(len(tokens) - 1, 0), dtype=np.float32)  # an empty prompt: refused below
    for rows, logits in _prompt_rows(model, tokens):
        out[rows] = logits.log_softmax(-1).gather(-1, targets[rows]).squeeze(1).numpy()
    return out


def prompt_logprobs(model: Transformer, tokens: Sequence[int]) -> list[float | None]:
    """One entry per token; entry 0 is None (no context), entry t = log p(tokens[t] | tokens[:t])."""
    return [None, *score_tokens(model, tokens).tolist()]


def prompt_top_k_logprobs(
    model: Transformer, tokens: Sequence[int], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, float32 logprobs), each [len(tokens), k], best first, raw model.
    Row 0 (no context) holds the sentinel (0, -99999.0) in every cell."""
    if k < 1:
        raise EngineUserError(f"topk_prompt_logprobs: expected >= 1, got {k}")
    k = min(k, model.config.vocab_size)
    ids = np.full((len(tokens), k), TOPK_SENTINEL[0], dtype=np.int32)
    lps = np.full((len(tokens), k), TOPK_SENTINEL[1], dtype=np.float32)
    for rows, logits in _prompt_rows(model, tokens):
        lp, top = logits.log_softmax(-1).topk(k, dim=-1)
        below = slice(rows.start + 1, rows.stop + 1)  # row 0 is the sentinel's
        ids[below], lps[below] = top.numpy(), lp.numpy()
    return ids, lps


def target_logprobs(model: Transformer, tokens: Sequence[int], targets: np.ndarray) -> np.ndarray:
    """float32 [len(tokens) - 1, K]: cell (i, j) = log p(targets[i, j] | tokens[:i+1]) under the
    raw model; cells holding -1 request nothing and return 0.0."""
    targets = np.asarray(targets)
    if targets.ndim != 2 or targets.shape[0] != len(tokens) - 1:
        raise EngineUserError(
            f"target_prompt_logprobs: expected shape [{len(tokens) - 1}, K] (one row per prompt "
            f"position after the first), got {list(targets.shape)}"
        )
    V = model.config.vocab_size
    if ((targets < -1) | (targets >= V)).any():
        raise EngineUserError(
            f"target_prompt_logprobs: ids must be -1 (none) or in [0, {V}); got "
            f"{int(targets[(targets < -1) | (targets >= V)][0])}"
        )
    t = torch.as_tensor(targets, dtype=torch.long)
    out = np.empty(targets.shape, dtype=np.float32)
    for rows, logits in _prompt_rows(model, tokens):
        picked = logits.log_softmax(-1).gather(-1, t[rows].clamp_min(0))
        out[rows] = picked.masked_fill(t[rows] < 0, 0.0).numpy()
    return out


@torch.inference_mode()
def prompt_alt_tokens(
    model: Transformer, tokens: Sequence[int], k: int, *, temperature: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """k tokens per prompt position 1.. drawn i.i.d. with replacement from
    softmax(logits / temperature) (greedy at 0) → (int64 ids, float32 log q), each [P - 1, k]."""
    if k < 1:
        raise EngineUserError(f"prompt_alt_tokens_k: expected >= 1, got {k}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise EngineUserError(f"temperature: expected a finite number >= 0, got {temperature}")
    n, greedy = len(tokens) - 1, temperature < GREEDY_BELOW_TEMPERATURE
    ids = np.empty((max(n, 0), k), dtype=np.int64)
    logq_ids = np.zeros((max(n, 0), k), dtype=np.float32)  # greedy: 0
    u = (
        None
        if greedy
        else torch.rand(max(n, 0), k, dtype=torch.float64, generator=_row_generator(seed, 0, "alt"))
    )
    for rows, logits in _prompt_rows(model, tokens):
        if greedy:
            top, best = logits.max(-1, keepdim=True)
            ids[rows] = best.expand(-1, k).numpy()
            logq_ids[rows] = np.where(np.isfinite(top.float().numpy()), 0.0, np.nan)
            continue
        logq = sampling_logprobs(logits, temperature, -1, 1.0)
        cdf = logq.exp().double().cumsum_(-1)
        assert u is not None
        chosen = _inverse_cdf(cdf, cdf.argmax(-1), u[rows])
        ids[rows], logq_ids[rows] = chosen.numpy(), logq.gather(-1, chosen).numpy()
    return ids, logq_ids
