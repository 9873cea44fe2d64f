"""`SandboxResult`: what one run of code came to, and how the model sees it."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

# The end of a Python traceback that says the code ran into one of its limits.
_LIMIT_ERRORS = (
    (re.compile(r"^[\w.]*MemoryError\b"), "memory"),
    (
        re.compile(r"(Errno 11\] Resource temporarily unavailable|can't start new thread)"),
        "processes",
    ),
    (re.compile(r"Errno 27\] File too large"), "file_size"),
    (re.compile(r"Errno 28\] No space left on device"), "disk"),
    (re.compile(r"Errno 24\] Too many open files"), "open_files"),
)


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """One run: its output (each stream cut to `SandboxLimits.max_output_bytes`; `*_bytes` is
    how much it wrote in all), its exit status (negative: killed by that signal; None: killed by
    the sandbox), which limit ended it if one did (`wall`, `cpu`, `memory`, `processes`,
    `file_size`, `disk`, `open_files`, `output`), its wall and CPU time, and the isolation it
    ran under (`namespaces` or `rlimits`).

    `memory`, `processes`, `file_size`, `disk` and `open_files` are read from the error the code
    died of (the last line of its stderr): the kernel refuses the allocation or the fork, and
    the code's own exception ends it.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    limit: str | None
    wall_s: float
    cpu_s: float
    stdout_bytes: int
    stderr_bytes: int
    isolation: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None

    @property
    def truncated(self) -> bool:
        return self.stdout_bytes > len(self.stdout.encode()) or self.stderr_bytes > len(
            self.stderr.encode()
        )

    def to_text(self) -> str:
        """The result as the model reads it: stdout, then stderr, then how it ended unless it
        ended well."""
        parts = [_stream(self.stdout, self.stdout_bytes)]
        if self.stderr_bytes:
            parts.append("stderr:\n" + _stream(self.stderr, self.stderr_bytes))
        if self.limit is not None:
            parts.append(f"[{self.limit} limit exceeded]")
        if self.exit_code:
            parts.append(f"[exit status {self.exit_code}]")
        text = "\n".join(p for p in parts if p)
        return text or "[no output]"


def _stream(text: str, total: int) -> str:
    shown = len(text.encode())
    if total > shown:
        return f"{text}\n[... output truncated: {total - shown} more bytes]"
    return text


def classify(exit_code: int | None, cpu_s: float, cpu_limit_s: float, stderr: str) -> str | None:
    """The limit a run that ended by itself ran into, if any."""
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_s >= cpu_limit_s):
        return "cpu"
    if exit_code == -signal.SIGXFSZ:
        return "file_size"
    if not exit_code:
        return None
    # The last lines: the processes a fork bomb left may write their tracebacks over each other.
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()][-3:]
    for pattern, limit in _LIMIT_ERRORS:
        if any(pattern.search(line) for line in lines):
            return limit
    return None
