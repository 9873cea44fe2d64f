"""`rollout: vllm`: the project's vLLM engine (`rllm_async.engines.vllm`), the one the local
backend samples with too, fed with the weights gathered from verl's workers after every step.

verl is imported only through the worker group handed in, so this module loads without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rllm_async.backends.verl.options import VerlOptions
from rllm_async.config import Config
from rllm_async.engines.vllm.engine import VLLMEngine
from rllm_async.protocols import Tokenizer


class VLLMRollout:
    """vLLM servers (`VLLMEngine`) that reload the trained weights as each new version.

    A sync is two halves: `export` gathers the full weights from the workers' FSDP shards and
    writes them (blocking: the backend runs it on its call thread, in order with the other worker
    calls), and `load` makes every server reload them, on the event loop that owns the engine's
    client. The servers start from the workers' own weights, so the first samples are the
    trainer's policy exactly (up to the served dtype).
    """

    colocated = False  # the servers keep sampling while the workers train

    def __init__(self, config: Config, opts: VerlOptions, workers: Any, tokenizer: Tokenizer):
        self.workers = workers
        pin = config.coordinator.weight_update == "pin"
        self.engine = VLLMEngine(
            opts.vllm,
            checkpoint=Path(opts.model_path).expanduser(),
            state=workers.export_weights()[0],
            tokenizer=tokenizer,
            max_seq_len=opts.max_seq_len,
            run_dir=config.run_path,
            # Pinned (mode: sync) no rollout spans a sync: wait for those in flight to finish.
            mode="wait" if pin else opts.vllm.partial_rollouts,
        )
        self.policy = self.engine.policy
        # verl's actor recomputes logprobs without a grammar's masks: constraints are refused,
        # not trained inexactly (docs/constrained_decoding.md).
        self.policy.constrains_decoding = False

    def pause(self) -> None:
        """Nothing to do: the servers do not share the training devices' memory with verl."""

    def export(self) -> Path:
        """Gather the trained weights from the workers and write them for the servers (blocking)."""
        return self.engine.write(self.workers.export_weights()[0])

    async def load(self, path: Path, version: int) -> float:
        """Make every server reload `path` as `version`; the seconds from pause to resume."""
        return await self.engine.load(path, version)

    async def close(self) -> None:
        """Close the client's connections, then stop the servers and delete the weight files."""
        await self.policy.close()
        self.engine.stop()
