"""`SandboxLimits`: what one run of model-written code may use, and the defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """The bounds of one run. The defaults suit short tool calls (a computation, a check).

    `wall_s` is a ceiling: a run gets the smaller of it and what its episode has left minus a
    margin (`SandboxPool.run`). `memory_bytes` is each process's address space (RLIMIT_AS), so
    all of a run's processes together may use up to `processes` times it. `disk_bytes` bounds
    the private directory (a tmpfs under namespaces); `file_bytes` bounds any one file written.
    `max_output_bytes` of stdout and of stderr each come back; a run whose output passes
    `output_limit_bytes` (either stream) is killed.
    """

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_bytes: int = 512 * 2**20
    processes: int = 32
    file_bytes: int = 16 * 2**20
    disk_bytes: int = 64 * 2**20
    open_files: int = 256
    max_output_bytes: int = 16 * 2**10
    output_limit_bytes: int = 2**20
    max_code_bytes: int = 2**20

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")
        if self.output_limit_bytes < self.max_output_bytes:
            raise ValueError("SandboxLimits.output_limit_bytes must be >= max_output_bytes")

    def rlimits(self) -> dict[str, int]:
        """The rlimits the launcher sets in the child (by their `resource.RLIMIT_*` names)."""
        return {
            "CPU": max(1, math.ceil(self.cpu_s)),
            "AS": int(self.memory_bytes),
            "NPROC": int(self.processes),
            "FSIZE": int(self.file_bytes),
            "NOFILE": int(self.open_files),
            "CORE": 0,
        }
