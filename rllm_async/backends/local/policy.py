"""The local backend's `PolicyClient`: a `Sampler` over a versioned `WeightStore`, also what verl's
`rollout: local` samples with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from rllm_async.backends.local.sampler import Sampler
from rllm_async.backends.local.snapshots import WeightStore
from rllm_async.protocols import Completion, SamplingParams, Tokenizer


class SamplerOptions(Protocol):
    """The options a sampler is started with (the local backend's, verl's `rollout: local`)."""

    max_batch: int  # sequences decoded together
    max_seq_len: int  # prompt + completion
    sampler_threads: int  # torch threads of the decode thread


class LocalPolicy:
    """The `PolicyClient` over a `Sampler` and the `WeightStore` it samples from.

    `constrains_decoding`: the sampler enforces `SamplingParams.structured`; true where the learner
    that trains on these samples applies the same masks (the local backend's), false under a
    learner that cannot (verl's), so that a constraint is refused rather than trained inexactly.
    """

    def __init__(self, sampler: Sampler, store: WeightStore, *, constrains_decoding: bool) -> None:
        self.sampler = sampler
        self._store = store
        self.constrains_decoding = constrains_decoding

    @classmethod
    def start(
        cls,
        store: WeightStore,
        tokenizer: Tokenizer,
        stop_ids: Sequence[int],
        opts: SamplerOptions,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        *,
        constrains_decoding: bool,
    ) -> LocalPolicy:
        """Start a sampler's decode thread on `store`'s weights; the policy client over it."""
        sampler = Sampler(
            store,
            tokenizer,
            stop_ids,
            max_batch=opts.max_batch,
            max_seq_len=opts.max_seq_len,
            device=device,
            dtype=dtype,
            threads=opts.sampler_threads,
            seed=seed,
        )
        return cls(sampler, store, constrains_decoding=constrains_decoding)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.sampler.tokenizer

    @property
    def max_context_tokens(self) -> int:
        """Prompt + completion tokens one sequence fits (`max_seq_len`)."""
        return self.sampler.max_seq_len

    def acquire(self) -> int:
        return self._store.acquire()

    def release(self, version: int) -> None:
        self._store.release(version)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion:
        return await self.sampler.generate(prompt_ids, params, version)
