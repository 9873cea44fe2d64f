"""The `tinker` backend: trains through the Tinker service with the official `tinker` SDK.

`TinkerBackend` is imported on first use, so the SDK is needed only when this backend is chosen.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "TinkerBackend":
        from rllm_async.backends.tinker.backend import TinkerBackend

        return TinkerBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
