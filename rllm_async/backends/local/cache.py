"""A slot KV cache: one row per concurrent sequence, so sequences join and leave between steps."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of up to `max_batch` sequences of up to `max_seq_len` tokens each."""

    def __init__(
        self,
        *,
        n_layers: int,
        max_batch: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (n_layers, max_batch, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_seq_len = max_seq_len

    def copy(self, source: int, target: int, length: int) -> None:
        """Give slot `target` the first `length` positions of slot `source` (a shared prompt)."""
        self.k[:, target, :, :length] = self.k[:, source, :, :length]
        self.v[:, target, :, :length] = self.v[:, source, :, :length]


class CacheView:
    """One forward pass over the cache: token j of row b goes to `positions[b, j]` of `slots[b]`.

    Each row attends to its own slot up to its own position; rows are independent, which is what
    lets sequences of different lengths share a batch.
    """

    def __init__(self, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.cache = cache
        self.slots = slots
        self.positions = positions
        self.length = int(positions.max()) + 1
        keys = torch.arange(self.length, device=positions.device)
        self.mask = (keys <= positions.unsqueeze(-1)).unsqueeze(1)  # [B, 1, T, length]
        # Consecutive slots are read as a view; any other set is gathered, which copies every
        # row's history (with `index_select`: advanced indexing is several times slower here).
        first = int(slots[0]) if slots.numel() else 0
        consecutive = torch.equal(
            slots, torch.arange(first, first + len(slots), device=slots.device)
        )
        self._rows = slice(first, first + len(slots)) if consecutive else slots

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's keys/values ([B, H, T, D]); return each row's slot up to `length`."""
        rows = self.slots.unsqueeze(-1)
        self.cache.k[layer, rows, :, self.positions] = k.transpose(1, 2)
        self.cache.v[layer, rows, :, self.positions] = v.transpose(1, 2)
        return self._read(self.cache.k[layer]), self._read(self.cache.v[layer])

    def _read(self, layer_cache: torch.Tensor) -> torch.Tensor:
        history = layer_cache[:, :, : self.length]
        if isinstance(self._rows, slice):
            return history[self._rows]
        return history.index_select(0, self._rows)
