"""verl's split-step actor worker with the two calls the backend adds: a scaled step, an export."""

from __future__ import annotations

import os
from typing import Any

import torch
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers_tinker import TinkerActorRolloutRefWorker

from rllm_async.backends.verl.loss import summed_policy_loss


class VerlWorker(TinkerActorRolloutRefWorker):
    """`TinkerActorRolloutRefWorker` (forward_backward, optimizer_step, optimizer_zero_grad) whose
    loss is ours, whose step first divides the summed gradients, and whose weights can be read."""

    def __init__(self, config: Any, role: str, **kwargs: Any) -> None:
        if os.environ.get("VERL_PLATFORM") == "cpu" and not torch.distributed.is_initialized():
            # verl's default backend string names the device twice ("cpu:gloo,cpu:gloo") on the CPU.
            torch.distributed.init_process_group(
                "gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
            )
        super().__init__(config, role, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        super().init_model()
        self.set_loss_fn(summed_policy_loss)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def optimizer_step_scaled(self, grad_scale: float, optim_step_params: dict[str, Any]) -> dict:
        """Multiply the accumulated gradients by `grad_scale`, then clip and step (verl's step)."""
        for param in self.actor.engine.module.parameters():
            if param.grad is not None:
                param.grad.mul_(grad_scale)
        return self.actor.optimizer_step(optim_step_params=optim_step_params)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """The full (unsharded) weights under their Hugging Face names, on rank 0; None elsewhere."""
        params, _ = self.actor.engine.get_per_tensor_param()
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in params}
        return state if self.rank == 0 else None
