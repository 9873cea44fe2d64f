"""Backends are found by name through the `rllm_async.backends` entry-point group."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from rllm_async.config import ConfigError

if TYPE_CHECKING:
    from rllm_async.protocols import BackendFactory


def available_backends() -> list[str]:
    return sorted(ep.name for ep in entry_points(group="rllm_async.backends"))


def get_backend_factory(name: str) -> BackendFactory:
    """The class registered under `name`; imported only now, so unused backends cost nothing."""
    matches = [ep for ep in entry_points(group="rllm_async.backends") if ep.name == name]
    if not matches:
        raise ConfigError(
            f"unknown backend.name '{name}': installed backends are "
            f"{', '.join(available_backends()) or 'none'} (is rllm-async installed with pip?)"
        )
    try:
        return matches[0].load()
    except ImportError as e:
        raise ConfigError(
            f"backend '{name}' is installed but cannot be imported ({e}); install its extra: "
            f"pip install 'rllm-async[{name}]'"
        ) from e
