"""Per-request decode state: keys and values of the full-attention layers, and the recurrent
state of Qwen3.5's linear-attention layers (`tinker_sr.engine.hybrid`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from tinker_sr.engine.model import ModelConfig


class KVCache:
    """Keys and values for every full-attention layer, allocated once for `batch_size` rows ×
    `max_len` positions; for each linear-attention layer (Qwen3.5) its convolution window
    ``conv[layer]`` [rows, channels, kernel - 1] and recurrent ``state[layer]`` [rows, value
    heads, key width, value width] (float32), the same size at any length."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        none = (batch_size, config.n_kv_heads, 0, config.head_dim)
        self.batch_size = batch_size
        self.max_len = max_len
        layers = range(config.n_layers)
        kv = [none if config.is_linear(i) else shape for i in layers]
        self.k = [torch.zeros(s, dtype=dtype, device=device) for s in kv]
        self.v = [torch.zeros(s, dtype=dtype, device=device) for s in kv]
        self.conv: dict[int, Tensor] = {}
        self.state: dict[int, Tensor] = {}
        for i in (i for i in layers if config.is_linear(i)):
            conv, state = _linear_state_shapes(config, batch_size)
            self.conv[i] = torch.zeros(conv, dtype=dtype, device=device)
            self.state[i] = torch.zeros(state, dtype=torch.float32, device=device)

    @staticmethod
    def nbytes_for(config: ModelConfig, rows: int, positions: int, dtype: torch.dtype) -> int:
        """Bytes a cache of ``rows`` × ``positions`` takes (before allocating it)."""
        size = torch.empty((), dtype=dtype).element_size()
        full = sum(not config.is_linear(i) for i in range(config.n_layers))
        total = rows * positions * 2 * full * config.n_kv_heads * config.head_dim * size
        if config.hybrid:
            conv, state = _linear_state_shapes(config, rows)
            linear = config.n_layers - full
            total += linear * (math.prod(conv) * size + math.prod(state) * 4)
        return total

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [b, H, T, D] at start_pos (b may be 1: broadcast to every row, which is how
        one prefill feeds many samples) and return the cache filled so far."""
        end = start_pos + k.shape[2]
        self.k[layer][:, :, start_pos:end] = k
        self.v[layer][:, :, start_pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def _linear_state_shapes(config: ModelConfig, rows: int) -> tuple[tuple[int, ...], ...]:
    channels = config.linear_k_heads * config.linear_k_dim * 2
    channels += config.linear_v_heads * config.linear_v_dim
    state = (rows, config.linear_v_heads, config.linear_k_dim, config.linear_v_dim)
    return (rows, channels, config.linear_conv - 1), state
