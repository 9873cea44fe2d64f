"""User callbacks: subclass `Callback` and override the hooks you need."""

from __future__ import annotations


class Callback:
    """Hooks the trainer calls at fixed points; each default does nothing."""

    def on_train_start(self, step: int) -> None:
        """Before the first step (`step` > 0 when resuming)."""

    def on_train_end(self, step: int) -> None:
        """After the last step, also when training stops early on an error."""

    def on_epoch_start(self, epoch: int) -> None:
        """When the first task of an epoch is dispatched."""

    def on_epoch_end(self, epoch: int) -> None:
        """When the last task of an epoch is dispatched."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """After each optimizer step, with that step's metrics record."""

    def on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
        """After each evaluation, with the step (policy version) it scored and its metrics."""
