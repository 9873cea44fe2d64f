"""The `local` backend: plain PyTorch on CPU or one GPU."""

from rllm_async.backends.local.backend import LocalBackend
from rllm_async.backends.local.options import LocalOptions
from rllm_async.backends.local.policy import LocalPolicy

__all__ = ["LocalBackend", "LocalOptions", "LocalPolicy"]
