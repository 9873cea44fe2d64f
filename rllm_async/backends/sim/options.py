"""The `backend:` options of the sim backend."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rllm_async.algorithms.sim_workload import LEN_CAP, LEN_MEDIAN, LEN_SIGMA

LENGTH_KEYS = ("len_median", "len_sigma", "len_cap")


class SimOptions(BaseModel):
    """The `backend:` keys of `name: sim`. Times are virtual seconds, rates tokens per second."""

    model_config = ConfigDict(extra="forbid")

    latency: Literal["ps", "zero"] = "ps"  # zero: generation, training and syncs take no time
    slots: int = Field(default=512, ge=1)
    rmax: float = Field(default=20000.0, gt=0.0)
    n_half: float = Field(default=64.0, ge=0.0)
    train_rate: float | None = Field(default=None, gt=0.0)
    train_ratio: float | None = Field(default=None, gt=0.0)  # T_train / T_gen(sync) per step
    t_sync: float = Field(default=0.5, ge=0.0)
    t_optim: float = Field(default=0.0, ge=0.0)  # seconds of each optimizer step
    # The share of the decode rate generation keeps while the learner trains and while it syncs
    # weights: 1 on devices of their own, below 1 on shared processors, 0 where a sync pauses.
    train_share: float = Field(default=1.0, ge=0.0, le=1.0)
    sync_share: float = Field(default=1.0, ge=0.0, le=1.0)
    # The share of its own speed training (and recomputing logprobs) keeps while generation
    # decodes beside it: 1 on devices of their own, below 1 where the two share one device.
    learner_share: float = Field(default=1.0, gt=0.0, le=1.0)
    # Seconds a constrained token's grammar mask adds to its sequence (SamplingParams.structured):
    # computed on the CPU beside the decode, it delays its own sequence and takes no decode rate
    # from the others. The default, 60 us, is a placeholder: the mean of `Grammars.fill` on
    # SmolLM2-135M's vocabulary (49,152 tokens) for a JSON schema and a forced tool call, one
    # thread of a shared 2-core CPU (benchmarks/grammar_mask_cost.py; docs/constrained_decoding.md).
    mask_s: float = Field(default=60e-6, ge=0.0)
    # Learner seconds per token drift: `train_growth` times the calibrated ones after
    # `train_drift_steps` optimizer steps (0: no drift), linearly or at once (`train_drift_shape`).
    train_growth: float = Field(default=1.0, gt=0.0)
    train_drift_steps: int = Field(default=0, ge=0)
    train_drift_shape: Literal["linear", "step"] = "linear"
    # The sampler-learner KL (`loss/sampler_kl`, nats per token) that each policy version of a
    # token's staleness adds, as a policy that moves per step makes it (0: not modelled, no
    # record); `kl_growth` times that after `kl_drift_steps` optimizer steps, linearly (0: none).
    kl_per_version: float = Field(default=0.0, ge=0.0)
    kl_growth: float = Field(default=1.0, gt=0.0)
    kl_drift_steps: int = Field(default=0, ge=0)
    sync_fail_every: int = Field(default=0, ge=0)  # 0: never
    sync_hang_every: int = Field(default=0, ge=0)  # 0: never
    # The rollout-length distribution train_ratio is calibrated on; from_config takes any of
    # these not given here from workflow.args, so the two cannot disagree silently.
    len_median: float = Field(default=LEN_MEDIAN, gt=0.0)
    len_sigma: float = Field(default=LEN_SIGMA, ge=0.0)
    len_cap: int = Field(default=LEN_CAP, ge=1)

    @model_validator(mode="after")
    def _one_train_speed(self) -> SimOptions:
        if self.train_rate is not None and self.train_ratio is not None:
            raise ValueError(
                "give one of backend.train_rate (tokens/s) or backend.train_ratio "
                "(T_train / T_gen), not both"
            )
        if self.train_rate is None and self.train_ratio is None:
            self.train_ratio = 0.3
        return self
