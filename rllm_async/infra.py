"""Infrastructure failures: a tool, sandbox or environment that failed through no fault of the model.

A rollout that ends in one is `infra_failed`: it is not a reward. It is kept out of its group's
statistics (the advantages are computed over the rest), never trained, counted in the step
records (`rollout/infra_failed`), and watched by its own failure-rate breaker
(`rollout.max_infra_failure_rate`). See docs/multi_turn.md, "Infrastructure failures".

A tool or environment says so by raising `InfraError` (or a subclass: a sandbox's `SandboxError`),
or an exception type registered with `register_infra_error` (a client library's connection error
that cannot subclass it); a workflow may also call `ctx.mark_infra_failed(reason)`. Anything
else a tool raises (bad code, a wrong call) is the model's doing and stays its reward.

This module imports nothing from the package, so that any tool can import it.
"""

from __future__ import annotations

__all__ = [
    "InfraError",
    "infra_error_types",
    "infra_failure",
    "is_infra_error",
    "register_infra_error",
]


class InfraError(Exception):
    """A failure of the infrastructure a rollout runs on (a tool's server, a sandbox, an
    environment), not of the model: the rollout is dropped from its group rather than scored.

    The message is shown when the infrastructure breaker stops the run: say what failed and how,
    e.g. `InfraError("sandbox 3f2a: container exited (OOM-killed)")`.
    """


_registered: tuple[type[BaseException], ...] = (InfraError,)


def register_infra_error(*types: type[BaseException]) -> None:
    """Count exceptions of `types` (and their subclasses) as infrastructure failures wherever a
    rollout raises them: for a library's errors that cannot subclass `InfraError`, e.g.
    `register_infra_error(docker.errors.APIError)`. Registering a type twice is harmless."""
    global _registered
    for t in types:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise TypeError(f"register_infra_error takes exception types, got {t!r}")
        if t not in _registered:
            _registered = (*_registered, t)


def infra_error_types() -> tuple[type[BaseException], ...]:
    """`InfraError` and every type registered with `register_infra_error`."""
    return _registered


def infra_failure(error: BaseException) -> BaseException | None:
    """The infrastructure failure in `error`: itself, or the first one an exception group holds
    (as `asyncio.TaskGroup` raises); None when it is not one (the model's or the workflow's)."""
    if isinstance(error, _registered):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = infra_failure(inner)
            if found is not None:
                return found
    return None


def is_infra_error(error: BaseException) -> bool:
    """Whether `error` is an infrastructure failure (see `infra_failure`)."""
    return infra_failure(error) is not None
