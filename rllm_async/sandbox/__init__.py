"""Sandboxed execution of model-written Python: limits, isolation, a pool (docs/sandbox.md)."""

from rllm_async.sandbox.error import SandboxError
from rllm_async.sandbox.limits import SandboxLimits
from rllm_async.sandbox.pool import SandboxPool
from rllm_async.sandbox.result import SandboxResult
from rllm_async.sandbox.sandbox import Sandbox

__all__ = ["Sandbox", "SandboxError", "SandboxLimits", "SandboxPool", "SandboxResult"]
