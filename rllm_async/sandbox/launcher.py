"""The sandbox's launcher: run as a script (`python -I launcher.py CONFIG`), never imported.

It runs inside the sandbox's namespaces (or, in the rlimits fallback, as the trainer's child),
prepares the filesystem view once, says `ready` on its status pipe, then runs one program: it
reads a header line (the run's limits) and the code from stdin, forks a child that sets its
rlimits, drops its privileges and execs `python -I -u -` with the code on its stdin, waits for it
and writes the child's exit status and CPU time on the status pipe. In a PID namespace it is the
namespace's init, so when it exits the kernel kills everything the code left behind.

Only the standard library: it runs before anything of the package could be trusted to import.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import stat
import sys
from typing import Any

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 32, 1024, 2048, 4096, 16384
_MS_RELATIME = 1 << 21
_PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 24, 36, 38
# statvfs flags that a remount must keep (a user namespace may not clear them: "locked").
_KEEP = (
    (os.ST_NOSUID, _MS_NOSUID),
    (os.ST_NODEV, _MS_NODEV),
    (os.ST_NOEXEC, _MS_NOEXEC),
    (os.ST_NOATIME, _MS_NOATIME),
    (os.ST_NODIRATIME, _MS_NODIRATIME),
    (os.ST_RELATIME, _MS_RELATIME),
)
_libc = ctypes.CDLL(None, use_errno=True)
_SETUP_FAILED = 70  # the launcher's own exit status when it could not prepare the sandbox


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3] or None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    # mountinfo escapes space, tab, newline and backslash as octal.
    return [p.encode().decode("unicode_escape").encode("latin-1").decode() for p in points]


def _traversable(path: str) -> bool:
    """Whether a user that is neither the owner nor in the group could pass through `path`."""
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def _closed_ancestor(path: str) -> str | None:
    """The highest directory above `path` that others cannot traverse (/root, mode 700)."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        d = "/" + "/".join(parts[:i])
        if not _traversable(d):
            return d
    return None


def _reopen_closed_dirs(needed: list[str]) -> None:
    """Make the paths the code needs (the interpreter, its libraries, the work directory)
    reachable for the unprivileged user when a directory above them is closed to others: an
    empty tmpfs over that directory hides the rest of it, and each needed path is bind-mounted
    back in at its own place."""
    by_dir: dict[str, list[str]] = {}
    for path in sorted(set(needed)):
        top = _closed_ancestor(path)
        if top is not None and not any(
            path.startswith(p + "/") for p in by_dir.get(top, [])
        ):  # sorted: a path's parents come first
            by_dir.setdefault(top, []).append(path)
    for top, paths in by_dir.items():
        fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in paths]
        _mount("tmpfs", top, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
        for path, fd in zip(paths, fds, strict=True):
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                open(path, "w").close()
            _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
            os.close(fd)


def _remount_read_only() -> None:
    """Every mount read-only, keeping the flags a user namespace locks; /proc, /sys and /dev,
    which the kernel guards itself, may refuse."""
    for point in _mount_points():
        try:
            flags = os.statvfs(point).f_flag
        except OSError:
            continue  # hidden under another mount, or gone
        if flags & os.ST_RDONLY:
            continue
        keep = sum(ms for st, ms in _KEEP if flags & st)
        try:
            _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | keep)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EACCES, errno.EINVAL, errno.ENOENT) or not (
                point.startswith(("/proc", "/sys", "/dev"))
            ):
                raise


def _setup(cfg: dict[str, Any]) -> None:
    if not cfg["mounts"]:
        return
    uid = cfg["uid"]
    if uid is not None:
        needed = [os.path.realpath(p) for p in [*cfg["needed"], cfg["workdir"]]]
        _reopen_closed_dirs([p for p in needed if os.path.exists(p)])
    _remount_read_only()
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    _mount(
        "tmpfs",
        cfg["workdir"],
        "tmpfs",
        _MS_NOSUID | _MS_NODEV,
        f"size={cfg['disk_bytes']},nr_inodes={cfg['inodes']},mode=700{owner}",
    )


def _drop_capabilities() -> None:
    """No capability survives the exec: the bounding set emptied, no new privileges."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except OSError:
        last = 40
    for cap in range(last + 1):
        try:
            _prctl(_PR_CAPBSET_DROP, cap)
        except OSError as e:
            if e.errno != errno.EPERM:  # without CAP_SETPCAP: not root, nothing to drop
                raise
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)


def _child(cfg: dict[str, Any], run: dict[str, Any], code_r: int, code_w: int) -> None:
    """In the forked child: limits, privileges, then the program. Never returns."""
    status = cfg["status_fd"]
    try:
        os.close(code_w)
        os.dup2(code_r, 0)
        os.close(code_r)
        os.set_inheritable(status, False)  # closed by the exec
        for name, value in run["rlimits"].items():
            limit = getattr(resource, f"RLIMIT_{name}")
            hard = value + 1 if name == "CPU" else value  # SIGXCPU first, SIGKILL a second later
            resource.setrlimit(limit, (value, hard))
        _drop_capabilities()
        uid = cfg["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        os.chdir(cfg["workdir"])
        env = dict(cfg["env"], HOME=cfg["workdir"], TMPDIR=cfg["workdir"])
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        os.execve(cfg["python"], [cfg["python"], "-I", "-u", "-"], env)
    except BaseException as e:
        try:
            os.write(status, (json.dumps({"error": f"child setup: {e!r}"}) + "\n").encode())
        finally:
            os._exit(_SETUP_FAILED)


def _sweep(uid: int) -> None:
    """Kill every process of the sandbox's user (those that left the process group) from a
    child that takes that user: kill(-1) reaches exactly them."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            for _ in range(100):
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    break
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _reap() -> None:
    """Wait for every process left to this launcher (as subreaper: the code's orphans too)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status = os.fdopen(cfg["status_fd"], "w", buffering=1)
    try:
        _setup(cfg)
    except Exception as e:
        status.write(json.dumps({"error": f"setup: {e!r}"}) + "\n")
        sys.exit(_SETUP_FAILED)
    if not cfg["pid_namespace"]:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # the code's orphans come back here to be reaped
    status.write(json.dumps({"ready": True}) + "\n")
    stdin = sys.stdin.buffer
    header = stdin.readline()
    if not header:
        return  # the sandbox closed before it ran anything
    run = json.loads(header)
    code = stdin.read(run["code_bytes"])
    code_r, code_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child(cfg, run, code_r, code_w)
    os.close(code_r)
    try:
        with open(code_w, "wb") as pipe:
            pipe.write(code)
    except BrokenPipeError:
        pass  # the child ended before it read its code; its status says why
    _, wait_status, usage = os.wait4(pid, 0)
    if cfg["uid"] is not None and not cfg["pid_namespace"]:
        _sweep(cfg["uid"])
    if not cfg["pid_namespace"]:
        _reap()
    status.write(
        json.dumps(
            {
                "exit": os.waitstatus_to_exitcode(wait_status),
                "cpu_s": usage.ru_utime + usage.ru_stime,
            }
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
