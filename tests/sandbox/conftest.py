"""Sandboxes for the tests, under each isolation this machine allows, with small limits; after
each test, no process of the sandbox remains and its directories are gone."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rllm_async.sandbox import Sandbox, SandboxLimits
from rllm_async.sandbox.isolation import namespaces_work
from rllm_async.sandbox.sandbox import _needed_paths, _open_to_all

# Small, so that a hostile program costs the host little: 16 processes of 256 MiB at most.
LIMITS = SandboxLimits(
    wall_s=20.0,
    cpu_s=2.0,
    memory_bytes=256 * 2**20,
    processes=16,
    file_bytes=2**20,
    disk_bytes=4 * 2**20,
    max_output_bytes=4096,
    output_limit_bytes=256 * 2**10,
)


def rlimits_python() -> str | None:
    """An interpreter the rlimits fallback can run as another user when the tests run as root
    (this one may sit under /root, closed to others), or None."""
    if os.geteuid() != 0 or _open_to_all(_needed_paths(sys.executable)):
        return sys.executable
    system = shutil.which("python3", path="/usr/bin:/bin")
    return system if system and _open_to_all(_needed_paths(system)) else None


def _params() -> list[object]:
    ns = pytest.param(
        "namespaces",
        marks=pytest.mark.skipif(namespaces_work() is not None, reason=str(namespaces_work())),
    )
    rl = pytest.param(
        "rlimits",
        marks=pytest.mark.skipif(rlimits_python() is None, reason="no interpreter open to all"),
    )
    return [ns, rl]


def _descendants() -> list[int]:
    """The processes below this one (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        out, todo = [], [os.getpid()]
        while todo:
            kids = children.get(todo.pop(), [])
            out += kids
            todo += kids
        return out
    return [p.pid for p in psutil.Process().children(recursive=True)]


def processes_of(uid: int | None) -> list[int]:
    if uid is None:
        return []
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _uid(e) == uid]


def _uid(entry: Path) -> int | None:
    try:
        return entry.stat().st_uid
    except OSError:
        return None


@dataclass
class Setup:
    """An isolation to test, the interpreter it runs, and a directory for its sandboxes."""

    isolation: str
    python: str | None
    root_dir: Path


@pytest.fixture(params=_params())
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    """Each isolation this machine allows; afterwards, nothing of a sandbox is left: no new process
    below this one or of a sandbox's user, no file in its directory."""
    isolation = request.param
    python = rlimits_python() if isolation == "rlimits" else None
    root = Path(tempfile.mkdtemp(prefix="rllm-sandbox-test-"))
    root.chmod(0o711)  # a sandbox's user must pass through it to its own directory
    # Processes other tests left below this one (a reward's worker pool, a learner) are not ours.
    before = set(_descendants())
    try:
        yield Setup(isolation, python, root)
        left = set(_descendants()) - before
        assert left == set(), "a sandboxed process outlived its sandbox"
        assert list(root.iterdir()) == [], "a sandbox left files behind"
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def sandbox(setup: Setup) -> Iterator[Sandbox]:
    """A sandbox under one isolation, closed and checked after the test."""
    box = Sandbox(LIMITS, setup.isolation, root_dir=str(setup.root_dir), python=setup.python)
    assert box.isolation == setup.isolation
    yield box
    asyncio.run(box.close())
    assert processes_of(box.uid) == []
