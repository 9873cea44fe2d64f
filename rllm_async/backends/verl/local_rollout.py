"""`rollout: local`: the local backend's sampler in this process, fed with weights exported from verl.

verl is imported only through the worker group handed in, so this module loads without it.
"""

from __future__ import annotations

from typing import Any

import torch

from rllm_async.backends.local.hf import Checkpoint
from rllm_async.backends.local.model import load_model
from rllm_async.backends.local.options import DTYPES
from rllm_async.backends.local.policy import LocalPolicy
from rllm_async.backends.local.snapshots import WeightStore
from rllm_async.backends.verl.options import VerlOptions


class LocalRollout:
    """The dynamic-batching sampler and its versioned `WeightStore` (pinned versions work).

    After every update `sync` gathers the full weights from the workers' FSDP shards (every worker
    takes part; rank 0 returns them through Ray) and publishes them as the new version.
    """

    colocated = False  # nothing to free on the training GPUs while they train

    def __init__(self, ckpt: Checkpoint, workers: Any, opts: VerlOptions, seed: int) -> None:
        self.workers = workers
        self.model_cfg = ckpt.config
        self.device = torch.device(opts.sampler_device)
        self.dtype = DTYPES[opts.sampler_dtype]
        self.store = WeightStore(0, self._snapshot(ckpt.state))
        # verl's actor recomputes logprobs without a grammar's masks: constraints are refused.
        self.policy = LocalPolicy.start(
            self.store,
            ckpt.tokenizer,
            ckpt.stop_ids,
            opts,
            self.device,
            self.dtype,
            seed,
            constrains_decoding=False,
        )
        self.sampler = self.policy.sampler

    def pause(self) -> None:
        """Nothing to do: the sampler does not share the training devices' memory with verl."""

    def sync(self, version: int) -> None:
        """Export the trained weights from the workers and publish them as `version` (blocking)."""
        state = self.workers.export_weights()[0]
        self.store.publish(version, self._snapshot(state))

    async def close(self) -> None:
        """Stop the sampler's decode thread."""
        self.sampler.close()

    def _snapshot(self, state: dict[str, torch.Tensor]) -> Any:
        """A frozen sampler model from Hugging Face-named weights."""
        tensors = {name.removeprefix("model."): t for name, t in state.items()}
        model = load_model(self.model_cfg, tensors, self.device, self.dtype)
        return model.eval().requires_grad_(False)
