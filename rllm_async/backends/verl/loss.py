"""The loss verl's engine calls on each micro-batch: our `policy_loss`, summed, never averaged.

verl's own losses divide by the tokens of the `forward_backward` call they are in. Ours returns the
summed loss (times the data-parallel size, which FSDP's gradient averaging divides back out), so
the gradients of a whole optimizer step add up and `VerlWorker.optimizer_step_scaled` divides
them once by the step's total loss tokens: streaming micro-batches equals one big batch.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from rllm_async.algorithms.losses import policy_loss
from rllm_async.config import LossConfig

LOSS_KEY = "rllm_loss"  # the LossConfig of the call, as a dict of non-tensor data


def summed_policy_loss(
    model_output: dict[str, torch.Tensor], data: TensorDict, dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's loss-function signature over our `policy_loss`; metrics are computed by the caller."""
    cfg = LossConfig.model_validate(tu.get_non_tensor_data(data, LOSS_KEY, None))
    logprobs = no_padding_2_padding(model_output["log_probs"], data)
    out = policy_loss(
        logprobs, data["old_log_probs"], data["advantages"], data["response_mask"], cfg
    )
    return out.loss_sum * data["dp_size"], {}
