"""A slot KV cache: one row per concurrent sequence, so sequences join and leave between steps."""

from __future__ import annotations

import torch

from rllm_async.backends.local.model import attention

BLOCK = 32  # positions per cache block: 16 and 64 decoded slower (docs/benchmarks.md)
SPREAD = 4  # a batch over a run of at most this many slots per row attends over the whole run


class KVCache:
    """Keys and values of up to `max_batch` sequences of up to `max_seq_len` tokens each.

    Stored block-major, [layers, blocks, batch, kv_heads, BLOCK, head_dim]: the first L positions
    of a run of slots are then a few dense blocks. Decoding attends over them about twice as fast
    as over the first L positions of every row of a [batch, kv_heads, max_seq_len, head_dim] cache
    (measured on the CPU, docs/benchmarks.md).
    """

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
        blocks = -(-max_seq_len // BLOCK)
        shape = (n_layers, blocks, max_batch, n_kv_heads, BLOCK, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_seq_len = max_seq_len

    def copy(self, source: int, target: int, length: int) -> None:
        """Give slot `target` the first `length` positions of slot `source` (a shared prompt).

        Whole blocks are copied: positions past `length` are masked until the target writes them.
        """
        blocks = -(-length // BLOCK)
        self.k[:, :blocks, target] = self.k[:, :blocks, source]
        self.v[:, :blocks, target] = self.v[:, :blocks, source]

    def view(self, slots: torch.Tensor, positions: torch.Tensor) -> CacheView:
        """One forward pass: token j of row b goes to `positions[b, j]` of slot `slots[b]`."""
        return CacheView(self, slots, positions)


class CacheView:
    """One forward pass over the cache: token j of row b goes to `positions[b, j]` of `slots[b]`.

    Each row attends to its own slot up to its own position; rows are independent, which is what
    lets sequences of different lengths share a batch.
    """

    def __init__(self, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.cache = cache
        self.slots = slots
        self.positions = positions
        self.blocks = int(positions.max()) // BLOCK + 1
        # Where each (row, token, kv head) goes in a layer's cache flattened to [-1, head_dim]:
        # one index_copy_ per layer writes them all (advanced-index assignment is slower).
        _, _, max_batch, kv_heads, _, _ = cache.k.shape
        heads = torch.arange(kv_heads, device=positions.device)
        first_row = (positions // BLOCK * max_batch + slots.unsqueeze(-1)) * kv_heads  # [B, T]
        rows = first_row.unsqueeze(-1) + heads  # [B, T, KV]
        self._write = (rows * BLOCK + (positions % BLOCK).unsqueeze(-1)).flatten()
        # Attention reads a run of slots as a view. When the batch's slots have gaps (requests
        # leave between steps; versions decode apart), queries are scattered into the run and
        # the rows between attend for nothing: cheaper than gathering the batch's rows, which
        # copies every row's history. Sparse sets are gathered (`index_select`; advanced
        # indexing is several times slower here).
        first, end = (int(slots.min()), int(slots.max()) + 1) if slots.numel() else (0, 0)
        self._spread: torch.Tensor | None = None
        self._rows: slice | torch.Tensor = slice(first, end)
        if end - first > SPREAD * len(slots):
            self._rows = slots
        elif end - first > len(slots) or not torch.equal(
            slots, torch.arange(first, end, device=slots.device)
        ):
            self._spread = slots - first
            run = positions.new_zeros(end - first, positions.shape[1])
            positions = run.index_copy_(0, self._spread, positions)  # idle rows see position 0
        keys = torch.arange(self.blocks * BLOCK, device=positions.device)
        visible = (keys <= positions.unsqueeze(-1)).unsqueeze(1)  # [rows, 1, T, blocks * BLOCK]
        # Additive, so that every layer adds it rather than inverting and filling a boolean one.
        self.mask = torch.zeros(visible.shape, device=positions.device, dtype=cache.k.dtype)
        self.mask.masked_fill_(~visible, float("-inf"))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this pass's keys/values ([B, KV, T, D]) into the slots, then attend over them."""
        d = k.shape[-1]
        self.cache.k[layer].view(-1, d).index_copy_(
            0, self._write, k.transpose(1, 2).reshape(-1, d)
        )
        self.cache.v[layer].view(-1, d).index_copy_(
            0, self._write, v.transpose(1, 2).reshape(-1, d)
        )
        keys, values = self._read(self.cache.k[layer]), self._read(self.cache.v[layer])
        if self._spread is not None:
            q = q.new_zeros(keys.shape[1], *q.shape[1:]).index_copy_(0, self._spread, q)
        if q.shape[2] == 1:
            out = decode_attention(q, keys, values, self.mask)
        else:  # prompts: lay the blocks out as rows ([B, KV, keys, D]) for one masked SDPA call
            out = attention(q, _rows_of(keys), _rows_of(values), self.mask)
        return out if self._spread is None else out.index_select(0, self._spread)

    def _read(self, layer_cache: torch.Tensor) -> torch.Tensor:
        """This batch's blocks in use, [blocks, B, KV, BLOCK, D]."""
        history = layer_cache[: self.blocks]
        if isinstance(self._rows, slice):
            return history[:, self._rows]
        return history.index_select(1, self._rows)


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """One query per row over block-major keys/values: [B, H, 1, D], [N, B, KV, BLOCK, D] and an
    additive [B, 1, 1, N * BLOCK] mask -> [B, H, 1, D].

    Each block is one batched matmul over dense memory. The query heads that share a key/value
    head form the rows of that matmul, so grouped-query attention repeats nothing.
    """
    n, b, kv, block, d = keys.shape
    h = q.shape[1]
    qg = q.reshape(b, kv, h // kv, d) * d**-0.5  # [B, KV, group, D], scaled here: it is smaller
    # Block by block: a block of a run of slots is one strided batch for `matmul`, where all the
    # blocks at once are not, and reshaping them into one copies the history (several times
    # slower than the attention itself).
    scores = torch.cat([qg @ keys[i].transpose(-1, -2) for i in range(n)], dim=-1) + mask
    probs = torch.softmax(scores, dim=-1)  # [B, KV, group, N * BLOCK]
    out = probs[..., :block] @ values[0]
    for i in range(1, n):
        out += probs[..., i * block : (i + 1) * block] @ values[i]
    return out.reshape(b, h, 1, d)


def _rows_of(blocks: torch.Tensor) -> torch.Tensor:
    """[N, B, KV, BLOCK, D] -> [B, KV, N * BLOCK, D]."""
    n, b, kv, block, d = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4).reshape(b, kv, n * block, d)
