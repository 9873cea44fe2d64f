"""Runs verl's training workers on the CPU: a `cpu` platform for verl's platform registry.

verl 0.9 selects devices through `verl.plugin.platform` and has platforms only for CUDA, ROCm and
NPU. This module registers one more, `cpu` (gloo for collectives, no device memory to manage), and
`worker_env()` gives the environment that makes a Ray worker pick it: `VERL_PLATFORM=cpu`, the FSDP
engine (registered by verl for `cuda`) through `VERL_ENGINE_DEVICE`, and this module imported by
`import verl` itself (`VERL_USE_EXTERNAL_MODULES`), before any verl module asks for the platform.
It was written against verl 0.9.1 and refuses any other version.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import types
from collections.abc import Iterator
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

CHECKED_VERSION = "0.9.1"

_found = importlib.metadata.version("verl")
if _found != CHECKED_VERSION:
    raise ImportError(
        f"rllm_async's CPU adaptation of verl was checked against verl {CHECKED_VERSION}, but verl "
        f"{_found} is installed: pip install 'verl[verl-core]=={CHECKED_VERSION}'"
    )


def _zero(*_: Any, **__: Any) -> int:
    return 0


def _nothing(*_: Any, **__: Any) -> None:
    return None


def _device_module() -> types.ModuleType:
    """`torch.cpu` plus the memory and RNG calls verl makes on its device module, as no-ops."""
    module = types.ModuleType("rllm_async_verl_cpu_device")
    extra: dict[str, Any] = {
        "mem_get_info": lambda *_: (0, 0),
        "get_rng_state": torch.get_rng_state,
        "set_rng_state": torch.set_rng_state,
        "get_device_name": lambda *_: "cpu",
    }
    for name in (
        "memory_allocated",
        "memory_reserved",
        "max_memory_allocated",
        "max_memory_reserved",
    ):
        extra[name] = _zero
    for name in (
        "empty_cache",
        "ipc_collect",
        "set_per_process_memory_fraction",
        "reset_peak_memory_stats",
    ):
        extra[name] = _nothing
    public = {k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("_")}
    module.__dict__.update({**public, **extra})
    return module


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU; chosen only through `VERL_PLATFORM=cpu`."""

    _module = _device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: a machine with accelerators keeps using them

    def current_device(self) -> Any:
        return "cpu"  # verl moves tensors with `.to(current_device())`

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "RLLM_ASYNC_VISIBLE_CPUS"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def worker_env() -> dict[str, str]:
    """Environment of a Ray worker that runs verl's FSDP engine on the CPU."""
    return {
        "VERL_PLATFORM": "cpu",
        "VERL_ENGINE_DEVICE": "cuda",  # the FSDP engine is registered for cuda/npu only
        "VERL_USE_EXTERNAL_MODULES": __name__,
    }
