"""The trainer side of the local backend: streaming gradient accumulation, then AdamW.

`forward_backward` adds the *summed* loss of its groups to the gradients; `optim_step` divides the
accumulated gradient by the step's total loss-token count, so the update is the token mean over the
whole step however the groups were split into micro-batches. Sequences that share a prompt are
packed into one row (`packing.py`), so a group's prompt is run once, not once per sample.

With `behaviour_logprobs: recomputed`, a batch's old logprobs are the learner's own before the
batch's first optimizer step: the first pass at that step takes them from its own forward pass
(the ratio is exactly 1), `record_old_logprobs` from a no-grad one for sequences trained only after
that step; every later pass over the batch reads them back.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rllm_async.algorithms.losses import LossStats, policy_loss
from rllm_async.algorithms.schedule import learning_rate
from rllm_async.backends.local.logprobs import Constraints, chunk_positions, packed_logprobs
from rllm_async.backends.local.lora import LoRA
from rllm_async.backends.local.model import Transformer
from rllm_async.backends.local.packing import PackedBatch, pack
from rllm_async.backends.local.transformers_model import Decoder
from rllm_async.config import LossConfig, OptimConfig
from rllm_async.grammar import Grammars
from rllm_async.types import TokenSequence, TrajectoryGroup


@dataclass
class _Row:
    sequence: TokenSequence
    advantage: float


class Learner:
    """Owns the trainable model, its AdamW optimizer and the schedule position; with `lora`, the
    model is the frozen base and only the adapters train."""

    def __init__(
        self,
        model: Decoder,
        optim: OptimConfig,
        *,
        total_steps: int,
        temperature: float,
        train_batch: int,
        compute_dtype: torch.dtype,
        ref_model: Decoder | None = None,
        lora: LoRA | None = None,
        updates_per_batch: int = 1,
        tokenizer: Any = None,
        stop_ids: Sequence[int] = (),
    ) -> None:
        self.model = model
        self.ref_model = ref_model
        self.lora = lora
        self.optim_cfg = optim
        self.total_steps = total_steps
        self.temperature = temperature
        self.train_batch = train_batch
        self.compute_dtype = compute_dtype
        self._chunk = chunk_positions(model.vocab_size)  # positions per chunk of logits
        self.step = 0
        self._params = list((model if lora is None else lora).parameters())
        self.optimizer = torch.optim.AdamW(
            self._params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
        )
        self._device = next(model.parameters()).device
        self._step_tokens = 0.0
        self.updates_per_batch = updates_per_batch
        # Old logprobs of the current batch's sequences (by their tokens), and that batch's index.
        self._old: dict[tuple[int, ...], torch.Tensor] = {}
        self._old_batch = -1
        # The sampler's grammar engine, remade here to replay the masks of constrained tokens.
        self._tokenizer, self._stop_ids = tokenizer, list(stop_ids)
        self._grammars: Grammars | None = None

    def forward_backward(self, groups: list[TrajectoryGroup], loss: LossConfig) -> dict[str, float]:
        """Accumulate the gradient of the summed loss of `groups`; return this batch's `loss/*`."""
        if loss.kl_coef > 0 and self.ref_model is None:
            raise ValueError(
                "algorithm.loss.kl_coef > 0 needs the reference model, which the local backend "
                "builds at start-up only when the config's kl_coef is > 0"
            )
        rows = [_Row(seq, adv) for g in groups for seq, adv in g.training_sequences()]
        stats = LossStats()
        for start in range(0, len(rows), self.train_batch):
            stats.merge(self._backward(rows[start : start + self.train_batch], loss))
        self._step_tokens += stats.tokens
        return stats.metrics()

    def record_old_logprobs(self, groups: list[TrajectoryGroup]) -> None:
        """Keep the current policy's logprobs of `groups` as their old logprobs: for sequences
        of this batch that are first trained after its first optimizer step."""
        self._check_batch_start("record_old_logprobs")
        seqs = [seq for g in groups for seq, _ in g.training_sequences()]
        for start in range(0, len(seqs), self.train_batch):
            chunk = seqs[start : start + self.train_batch]
            packed = pack(
                [s.tokens for s in chunk],
                [s.loss_mask.index(1) for s in chunk],
                share_prompts=self.model.shares_prompts,
            )
            mask = self._loss_mask(chunk, packed.width).to(self._device)
            constraints = self._constraints(chunk, packed.width)
            with torch.no_grad(), self._autocast():
                logprobs = self._logprobs(self.model, packed.to(self._device), mask, constraints)
            for seq, row in zip(chunk, logprobs, strict=True):
                self._old.setdefault(tuple(seq.tokens), row[: len(seq.tokens) - 1].clone())

    def optim_step(self) -> dict[str, float]:
        """Apply the step's accumulated gradient (token mean), clip it, and advance the schedule."""
        lr = learning_rate(self.optim_cfg, self.step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = 0.0
        if self._step_tokens > 0:
            for grad in (p.grad for p in self._params if p.grad is not None):
                grad.div_(self._step_tokens)
            max_norm = self.optim_cfg.grad_clip or math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, max_norm))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {
            "optim/lr": lr,
            "optim/grad_norm": grad_norm,
            "optim/num_tokens": self._step_tokens,
        }
        self.step += 1
        self._step_tokens = 0.0
        return metrics

    def merged_model(self) -> Decoder:
        """The model to sample with: the trained model itself, or a copy with the adapters merged."""
        if self.lora is None:
            return self.model
        assert isinstance(self.model, Transformer)  # LoRA adapts our decoder only
        return self.lora.merged_copy(self.model)

    def state_dict(self) -> dict[str, Any]:
        """Weights (the base's and the adapters'), optimizer moments and the schedule position as
        of the last `optim_step`: gradients accumulated since are not part of it (an interrupted
        step is taken again from its start)."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
        }
        if self.lora is not None:
            state["lora"] = self.lora.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if ("lora" in state) != (self.lora is not None):
            saved = "with" if "lora" in state else "without"
            raise ValueError(
                f"the checkpoint was saved {saved} LoRA adapters and backend.lora is "
                f"{'not ' if self.lora is None else ''}set: resume with the backend.lora setting "
                "it was trained with"
            )
        self.model.load_state_dict(state["model"])
        if self.lora is not None:
            self.lora.load_state_dict(state["lora"])
        if "optimizer" in state:  # else a weights-only checkpoint: the moments start from zero
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            self.optimizer.state.clear()
        self.step = int(state["step"])
        self.optimizer.zero_grad(set_to_none=True)
        self._step_tokens = 0.0
        self._old.clear()
        self._old_batch = -1

    def _backward(self, rows: list[_Row], loss: LossConfig) -> LossStats:
        seqs = [r.sequence for r in rows]
        packed = pack(
            [s.tokens for s in seqs],
            [s.loss_mask.index(1) for s in seqs],
            share_prompts=self.model.shares_prompts,
        )
        packed = packed.to(self._device)
        mask, sampler_lp, adv = self._batch(rows, packed.width)
        constraints = self._constraints(seqs, packed.width)
        with self._autocast():
            logprobs = self._logprobs(self.model, packed, mask, constraints)
            ref = None
            if self.ref_model is not None and loss.kl_coef > 0:
                with torch.no_grad():
                    ref = self._logprobs(self.ref_model, packed, mask, constraints)
        old = None
        if loss.behaviour_logprobs == "recomputed":
            old = self._old_logprobs(seqs, logprobs.detach())
        out = policy_loss(logprobs, sampler_lp, adv, mask, loss, ref_logprobs=ref, old_logprobs=old)
        if out.stats.tokens > 0:
            out.loss_sum.backward()
        return out.stats

    def _check_batch_start(self, what: str) -> None:
        """Start a new batch's old logprobs when the step is a batch's first; refuse to record
        them at any other step, where the policy is no longer the batch's old one."""
        batch, offset = divmod(self.step, self.updates_per_batch)
        if batch != self._old_batch:
            self._old.clear()
            self._old_batch = batch
        if offset:
            raise RuntimeError(
                f"{what}: old logprobs are recorded before a batch's first optimizer step, but "
                f"this is step {offset} of the batch's {self.updates_per_batch}: every sequence of "
                "a batch must be trained or recorded before its first optim_step"
            )

    def _old_logprobs(self, seqs: list[TokenSequence], current: torch.Tensor) -> torch.Tensor:
        """The old logprobs of `seqs` in `current`'s layout: at a batch's first step, the current
        ones (recorded for the later passes); after it, the recorded ones."""
        if self.step % self.updates_per_batch == 0:
            self._check_batch_start("forward_backward")
            if self.updates_per_batch > 1:  # a later pass will read them
                for seq, row in zip(seqs, current, strict=True):
                    self._old.setdefault(tuple(seq.tokens), row[: len(seq.tokens) - 1].clone())
            return current
        old = torch.zeros_like(current)
        for i, seq in enumerate(seqs):
            row = self._old.get(tuple(seq.tokens))
            if row is None or self.step // self.updates_per_batch != self._old_batch:
                raise RuntimeError(
                    "forward_backward: a sequence has no old logprobs in this batch: with "
                    "algorithm.loss.behaviour_logprobs: recomputed, every sequence of a batch is "
                    "trained or passed to record_old_logprobs before its first optim_step"
                )
            old[i, : row.numel()] = row
        return old

    def _logprobs(
        self,
        model: Decoder,
        packed: PackedBatch,
        mask: torch.Tensor,
        constraints: Constraints | None,
    ) -> torch.Tensor:
        """Logprobs of the tokens `mask` trains, in the unpacked [rows, width] next-token layout
        (zero elsewhere: every reader masks them), chunk by chunk of logits."""
        return packed_logprobs(model, packed, mask, self.temperature, self._chunk, constraints)

    def _constraints(self, seqs: list[TokenSequence], width: int) -> Constraints | None:
        """The grammar masks of the constrained spans of `seqs`, replayed over their sampled tokens
        (the masks the sampler drew them under); None when no span is constrained."""
        dest: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        for row, seq in enumerate(seqs):
            for start, end, structured in seq.constraints:
                masks.append(self._grammar().sequence_masks(structured, seq.tokens[start:end]))
                # Token j is predicted at column j - 1 of the next-token layout.
                dest.append(torch.arange(start - 1, end - 1) + row * width)
        if not dest:
            return None
        return Constraints(torch.cat(dest).to(self._device), torch.cat(masks))

    def _grammar(self) -> Grammars:
        if self._grammars is None:
            if self._tokenizer is None:
                raise ValueError(
                    "a sequence was sampled under a decoding constraint, but this learner has no "
                    "tokenizer to replay the grammar's masks with: build it with the sampler's"
                )
            self._grammars = Grammars(self._tokenizer, self.model.vocab_size, self._stop_ids)
        return self._grammars

    @staticmethod
    def _loss_mask(seqs: list[TokenSequence], width: int) -> torch.Tensor:
        """The right-padded next-token loss mask [len(seqs), width]: 1 where a token is trained."""
        mask = torch.zeros(len(seqs), width)
        for i, seq in enumerate(seqs):
            mask[i, : len(seq.tokens) - 1] = torch.tensor(seq.loss_mask[1:], dtype=torch.float32)
        return mask

    def _batch(self, rows: list[_Row], width: int) -> tuple[torch.Tensor, ...]:
        """Right-padded next-token tensors: loss mask, sampler logprobs, advantages."""
        shape = (len(rows), width)
        mask = self._loss_mask([r.sequence for r in rows], width)
        sampler_lp, adv = torch.zeros(shape), torch.zeros(shape)
        for i, row in enumerate(rows):
            seq, n = row.sequence, len(row.sequence.tokens) - 1
            sampler_lp[i, :n] = torch.tensor(seq.logprobs[1:], dtype=torch.float32)
            adv[i, :n] = row.advantage * mask[i, :n]
        return tuple(t.to(self._device) for t in (mask, sampler_lp, adv))

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self._device.type, dtype=self.compute_dtype)
