"""The `verl` backend: verl 0.9's FSDP training workers on Ray.

`VerlBackend` is imported on first use, so verl and Ray are needed only when this backend is chosen.
"""

from __future__ import annotations

from typing import Any

INSTALL_HINT = "pip install 'rllm-async[verl]'"


def __getattr__(name: str) -> Any:
    if name == "VerlBackend":
        try:
            import verl  # noqa: F401
        except ImportError as e:
            raise ImportError(f"backend verl needs the verl package ({e}): {INSTALL_HINT}") from e
        from rllm_async.backends.verl.backend import VerlBackend

        return VerlBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
