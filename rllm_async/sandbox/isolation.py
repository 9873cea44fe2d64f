"""Which isolation this machine allows: Linux namespaces through util-linux's `unshare`, or
rlimits alone; found once per process and logged once."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess

from rllm_async.sandbox.error import SandboxError

log = logging.getLogger(__name__)

NAMESPACES = "namespaces"
RLIMITS = "rlimits"
ISOLATIONS = ("auto", NAMESPACES, RLIMITS)


def unshare_argv() -> list[str] | None:
    """The `unshare` command that puts a program in new network, PID, mount, IPC and UTS
    namespaces (and a user namespace when not root), or None without util-linux's `unshare`."""
    path = shutil.which("unshare")
    if path is None:
        return None
    argv = [path]
    if os.geteuid() != 0:
        argv += ["--user", "--map-root-user"]
    return [*argv, "--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child",
            "--mount-proc"]  # fmt: skip


@functools.cache
def namespaces_work() -> str | None:
    """None when `unshare` can make the sandbox's namespaces here, else why not."""
    argv = unshare_argv()
    if argv is None:
        return "util-linux's unshare is not installed"
    try:
        done = subprocess.run([*argv, "true"], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if done.returncode != 0:
        return f"unshare failed: {done.stderr.decode(errors='replace').strip()}"
    return None


_logged: set[str] = set()


def resolve(isolation: str) -> str:
    """The isolation a sandbox asked for `isolation` gets: `auto` is namespaces where they work
    and rlimits elsewhere; `namespaces` where they do not work raises SandboxError."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    why_not = namespaces_work() if isolation != RLIMITS else None
    if isolation == NAMESPACES and why_not is not None:
        raise SandboxError(f"namespace isolation is unavailable: {why_not}")
    chosen = RLIMITS if isolation == RLIMITS or why_not is not None else NAMESPACES
    if chosen not in _logged:
        _logged.add(chosen)
        if chosen == NAMESPACES:
            log.info("sandbox isolation: namespaces (unshare: network, PID, mount) and rlimits")
        else:
            reason = "as configured" if isolation == RLIMITS else why_not
            log.warning(
                "sandbox isolation: rlimits only (%s); the code has the network and can write "
                "where its user may",
                reason,
            )
    return chosen
