"""`SandboxError`: the sandbox itself failed, which is never the model's doing."""

from __future__ import annotations

from rllm_async.infra import InfraError


class SandboxError(InfraError):
    """The sandbox could not run the code: its isolation tool is missing or broken, its launcher
    could not start or set up, or it ended without a status.

    An infrastructure failure, distinct from anything the model's code does (raising, exiting
    non-zero, hitting a limit: those are a `SandboxResult` the model sees). It propagates out of
    the tool and the workflow, so that the rollout fails as an infrastructure failure and is
    never scored as the model's reward.
    """
