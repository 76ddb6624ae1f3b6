"""Decode steps on a CUDA device replayed from a CUDA graph.

On a GPU a decode step of a small model is bound by kernel launches, not by arithmetic: each
step launches ~60 kernels a layer from Python (a 42M-parameter Qwen3 at 8 rows: ~480 launches,
~10 ms, the GPU busy ~15 % of it). Captured once into a `torch.cuda.CUDAGraph`, the same step
is one launch from the CPU.

A graph fixes every shape and address, so a graphable model's decode steps all run
`static_step`, which differs from `batching.decode_step` in three ways, each chosen to make its
shapes those of the requests rather than of the position or of which rows are still running:

- every row of every request runs (rows that stopped are fed token 0 and their results
  dropped), so a row stopping does not change the batch;
- attention reads each request's whole KV cache, positions past the current one masked, and
  the step writes its keys and values at a position held in a device tensor;
- the inputs that change each step (tokens, RoPE angles, positions) are copied into the
  graph's own tensors before each replay; the logits come back to the CPU as in eager decode.

Its products are decode's (`batching.linear_rows`: a row's result does not depend on the
rows beside it, as probed on the device) and attention runs per request, so a request's
values do not depend on the other requests in the step nor on whether the step was replayed;
they differ from `batching.decode_step`'s by rounding (attention over masked positions).

One graph is kept per model, for one set of requests (their KV caches). A set's first step
runs `static_step` as it is (a set that changed every step would pay a capture each step);
its second runs it as the capture's warm-up, then captures it; every later step of the same
set replays. Models with a mixture of experts (routing is data-dependent) and with gpt-oss's
sink or windowed attention decode with `batching.decode_step`, as does every model with
``$TINKER_SR_CUDA_GRAPHS=0`` and every CPU model.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from tinker_sr.engine.batching import (
    DecodeRows,
    attention_rows,
    decode_step,
    delta_rows,
    linear_rows,
    mlp_rows,
    padded_rows,
)
from tinker_sr.engine.fused import rotate_eager
from tinker_sr.engine.hybrid import GatedDeltaNet, partial_rope
from tinker_sr.engine.model import MLP, Attention, DecoderLayer, SparseMoe, Transformer
from tinker_sr.engine.rope import rope_angles

if TYPE_CHECKING:
    from tinker_sr.engine.kv_cache import KVCache

GRAPHS_ENV = "TINKER_SR_CUDA_GRAPHS"
STABLE_STEPS = 2  # a set of requests is captured at its second decode step in a row
_log = logging.getLogger(__name__)


def graphs_enabled() -> bool:
    """CUDA graphs for decode unless ``$TINKER_SR_CUDA_GRAPHS`` is ``0``."""
    return os.environ.get(GRAPHS_ENV, "").strip() not in ("0", "false", "off")


def graphable(model: Transformer) -> bool:
    """Whether ``model``'s decode steps can be captured: on CUDA, no mixture of experts, no
    sink or windowed attention, and graphs not turned off."""
    if model.device.type != "cuda" or not graphs_enabled():
        return False
    for layer in cast(Sequence[DecoderLayer], model.model.layers):
        if isinstance(layer.mlp, SparseMoe):
            return False
        attn = getattr(layer, "self_attn", None)
        if attn is not None and (getattr(attn, "sinks", None) is not None or attn.window):
            return False
    return True


@dataclass
class StaticInputs:
    """What a graphed step reads that changes between steps, in tensors of fixed address."""

    tokens: Tensor  # int64 [rows]: the token each row feeds (0 for padding and stopped rows)
    cos: Tensor  # [rows, 1, rotary dim]: each row's angles at its request's position
    sin: Tensor
    pos: Tensor  # int64 [groups]: each request's position this step
    offsets: list[int] = field(default_factory=list)  # first row of each request

    @classmethod
    def allocate(cls, model: Transformer, groups: Sequence[DecodeRows]) -> StaticInputs:
        sizes = [g.cache.batch_size for g in groups]
        rows = padded_rows(sum(sizes))
        width = model.inv_freq.shape[0] * 2
        dev, dtype = model.device, model.dtype
        offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        return cls(
            tokens=torch.zeros(rows, dtype=torch.long, device=dev),
            cos=torch.zeros(rows, 1, width, dtype=dtype, device=dev),
            sin=torch.zeros(rows, 1, width, dtype=dtype, device=dev),
            pos=torch.zeros(len(groups), dtype=torch.long, device=dev),
            offsets=offsets,
        )

    def fill(self, model: Transformer, groups: Sequence[DecodeRows]) -> None:
        """This step's tokens, angles and positions (built on the CPU, copied once each)."""
        rows = self.tokens.shape[0]
        tokens = torch.zeros(rows, dtype=torch.long)
        cos = torch.zeros(self.cos.shape, dtype=self.cos.dtype)
        sin = torch.zeros_like(cos)
        for g, start in zip(groups, self.offsets, strict=False):
            n = g.cache.batch_size
            tokens[start + g.active] = g.fed_tokens.cpu()
            c, s = rope_angles(model.inv_freq.cpu(), g.pos, 1, cos.dtype, cos.device,
                               model.rope_scale)  # fmt: skip
            cos[start : start + n] = c
            sin[start : start + n] = s
        self.tokens.copy_(tokens)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.pos.copy_(torch.tensor([g.pos for g in groups]))


def static_step(model: Transformer, groups: Sequence[DecodeRows], inputs: StaticInputs) -> Tensor:
    """One decode step of every row of ``groups`` from ``inputs`` with fixed shapes (module
    docstring) -> float32 logits [padded rows, V] on the model's device. Runs on any device;
    on CUDA it is what a graph captures."""
    x = model.model.embed_tokens(inputs.tokens)
    for i, layer in enumerate(cast(Sequence[DecoderLayer], model.model.layers)):
        h = layer.input_layernorm(x)
        if hasattr(layer, "linear_attn"):
            x = x + _linear_attention(layer.linear_attn, h, groups, inputs, i)
        else:
            x = x + _attention(layer.self_attn, h, groups, inputs, i)
        x = x + mlp_rows(cast(MLP, layer.mlp), layer.post_attention_layernorm(x))
    return linear_rows(model.lm_head, model.model.norm(x)).float()


def _attention(
    attn: Attention, h: Tensor, groups: Sequence[DecodeRows], inputs: StaticInputs, layer: int
) -> Tensor:
    rows = h.shape[0]
    q, k, v, gate = attention_rows(attn, h)
    q, k = (partial_rope(t, inputs.cos, inputs.sin, rotate_eager) for t in (q, k))
    y = torch.zeros(rows, attn.n_heads * attn.head_dim, dtype=h.dtype, device=h.device)
    for j, g in enumerate(groups):
        a, b = inputs.offsets[j], inputs.offsets[j + 1]
        keys, values = g.cache.k[layer], g.cache.v[layer]
        at = inputs.pos[j : j + 1]
        keys.index_copy_(2, at, k[a:b, :, None].to(keys.dtype))
        values.index_copy_(2, at, v[a:b, :, None].to(values.dtype))
        seen = (torch.arange(keys.shape[2], device=keys.device) <= at)[None]  # [1, max_len]
        out = F.scaled_dot_product_attention(
            q[a:b, :, None], keys, values, attn_mask=seen, enable_gqa=True
        )
        y[a:b] = out.reshape(b - a, -1)
    if gate is not None:
        y = y * torch.sigmoid(gate)
    return linear_rows(attn.o_proj, y)


def _linear_attention(
    net: GatedDeltaNet, h: Tensor, groups: Sequence[DecodeRows], inputs: StaticInputs, layer: int
) -> Tensor:
    qkv, z, b_, a_ = delta_rows(net, h)
    y = torch.zeros(h.shape[0], net.v_heads * net.v_dim, dtype=h.dtype, device=h.device)
    for j, g in enumerate(groups):
        a, b = inputs.offsets[j], inputs.offsets[j + 1]
        conv, state = g.cache.conv[layer], g.cache.state[layer]
        y[a:b] = net.step(qkv[a:b], z[a:b], b_[a:b], a_[a:b], conv, state)
    return linear_rows(net.out_proj, y)


class GraphedDecode:
    """One model's captured decode step, for one set of requests (module docstring)."""

    def __init__(self) -> None:
        self.caches: list[weakref.ref[KVCache]] = []  # the captured requests' caches
        self.inputs: StaticInputs | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None
        self.pending: tuple[int, ...] = ()  # a set of requests not captured yet ...
        self.seen = 0  # ... and for how many steps in a row it has decoded
        self.captures = 0
        self.replays = 0
        self.failed: str | None = None  # why a capture failed (then steps run uncaptured)

    def _captured(self, groups: Sequence[DecodeRows]) -> bool:
        return (
            self.graph is not None
            and len(groups) == len(self.caches)
            and all(ref() is g.cache for ref, g in zip(self.caches, groups, strict=True))
        )

    @torch.inference_mode()
    def step(self, model: Transformer, groups: Sequence[DecodeRows]) -> list[Tensor]:
        """Logits [len(active), V] per group (CPU float32), as `batching.decode_step`
        returns them, from `static_step`: replayed where this set of requests is captured,
        captured at its `STABLE_STEPS`-th step in a row (a set that changed every step would
        pay a capture each step), else run as it is."""
        if self._captured(groups):
            assert self.inputs is not None and self.logits is not None and self.graph
            self.inputs.fill(model, groups)
            self.graph.replay()
            self.replays += 1
            return _per_group(self.logits.cpu(), groups, self.inputs)
        key = tuple(id(g.cache) for g in groups)
        self.seen = self.seen + 1 if key == self.pending else 1
        self.pending = key
        inputs = StaticInputs.allocate(model, groups)
        if self.seen < STABLE_STEPS or self.failed is not None:
            inputs.fill(model, groups)
            return _per_group(static_step(model, groups, inputs).cpu(), groups, inputs)
        return _per_group(self._capture(model, groups, inputs).cpu(), groups, inputs)

    def _capture(
        self, model: Transformer, groups: Sequence[DecodeRows], inputs: StaticInputs
    ) -> Tensor:
        """This step run eagerly on a side stream (the warm-up a capture needs; its logits are
        this step's), then the graph of the next steps captured without running."""
        self.graph = self.logits = self.inputs = None  # the old graph's memory goes first
        self.caches = []
        inputs.fill(model, groups)
        main = torch.cuda.current_stream(model.device)
        side = torch.cuda.Stream(device=model.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            logits = static_step(model, groups, inputs)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                captured = static_step(model, groups, inputs)
        except Exception as e:  # an op that cannot be captured: decode this model eagerly
            self.failed = f"{type(e).__name__}: {e}"
            _log.warning("CUDA graph capture failed; decoding eagerly (%s)", self.failed)
            return logits
        self.caches = [weakref.ref(g.cache) for g in groups]
        self.inputs, self.graph, self.logits = inputs, graph, captured
        self.captures += 1
        return logits


def _per_group(logits: Tensor, groups: Sequence[DecodeRows], inputs: StaticInputs) -> list[Tensor]:
    """The active rows' logits of each group from a graphed step's [padded rows, V]."""
    out = []
    for j, g in enumerate(groups):
        rows = logits[inputs.offsets[j] : inputs.offsets[j + 1]]
        out.append(rows if len(g.active) == g.cache.batch_size else rows[g.active])
    return out


_graphs: weakref.WeakKeyDictionary[Transformer, GraphedDecode] = weakref.WeakKeyDictionary()


def graphed(model: Transformer) -> GraphedDecode:
    """``model``'s `GraphedDecode` (made on first use)."""
    found = _graphs.get(model)
    if found is None:
        found = _graphs[model] = GraphedDecode()
    return found


def decode(model: Transformer, groups: Sequence[DecodeRows]) -> list[Tensor]:
    """`batching.decode_step`'s logits: through `static_step` and its CUDA graphs where
    ``model`` allows graphs (`graphable`), else `batching.decode_step` itself."""
    if not graphable(model):
        return decode_step(model, groups)
    return graphed(model).step(model, groups)
