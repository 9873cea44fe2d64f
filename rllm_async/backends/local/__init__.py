"""The `local` backend: plain PyTorch on CPU or one GPU."""

from rllm_async.backends.local.backend import LocalBackend, LocalOptions, LocalPolicy

__all__ = ["LocalBackend", "LocalOptions", "LocalPolicy"]
