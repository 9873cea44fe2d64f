"""Hostile programs end in bounded time with a clear result and leave the host as it was: the
fixtures check that no process and no file of the sandbox remains after each. Limits are small
(tests/sandbox/conftest.py) and timing is only ever asserted as a generous hang bound."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from pathlib import Path

import pytest

from rllm_async.sandbox import Sandbox, SandboxLimits, SandboxResult

HANG_S = 60.0  # far above any limit here: a run that takes this long has hung


def run(sandbox: Sandbox, code: str, wall_s: float | None = None) -> SandboxResult:
    async def main() -> SandboxResult:
        return await asyncio.wait_for(sandbox.run(code, wall_s), HANG_S)

    return asyncio.run(main())


def test_a_fork_bomb_hits_the_process_limit(sandbox: Sandbox) -> None:
    result = run(sandbox, "import os\nwhile True:\n    os.fork()")
    assert result.limit in ("processes", "wall"), result
    assert "Resource temporarily unavailable" in result.stderr or result.limit == "wall"


def test_daemons_that_leave_the_session_are_still_killed(sandbox: Sandbox) -> None:
    code = (
        "import os, time\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(3600)\n"
        "        os._exit(0)\n"
        "print('parent done')"
    )
    result = run(sandbox, code)
    assert result.ok and result.stdout == "parent done\n"  # the fixture: none of them is left


def test_a_memory_blow_up_hits_the_memory_limit(sandbox: Sandbox) -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))"
    result = run(sandbox, code)
    assert result.limit == "memory" and result.exit_code == 1
    assert "MemoryError" in result.stderr


def test_an_infinite_loop_hits_the_cpu_limit(sandbox: Sandbox) -> None:
    result = run(sandbox, "while True:\n    pass")
    assert result.limit == "cpu" and result.exit_code is not None and result.exit_code < 0
    assert "[cpu limit exceeded]" in result.to_text()


def test_a_program_that_sleeps_forever_hits_the_wall_limit(sandbox: Sandbox) -> None:
    result = run(sandbox, "import time\nprint('started', flush=True)\ntime.sleep(3600)", 2.0)
    assert result.limit == "wall" and result.exit_code is None
    assert result.stdout == "started\n"  # output before the kill comes back


def test_an_output_flood_is_cut_and_killed_with_bounded_memory(sandbox: Sandbox) -> None:
    result = run(sandbox, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    limits = sandbox.limits
    assert result.limit == "output"
    assert len(result.stdout) == limits.max_output_bytes and result.truncated
    assert result.stdout_bytes > limits.output_limit_bytes
    assert "output truncated" in result.to_text()


def test_a_huge_file_hits_the_file_size_limit(sandbox: Sandbox) -> None:
    result = run(sandbox, "open('big', 'wb').write(b'x' * (64 * 2**20))")
    assert result.limit == "file_size" and "File too large" in result.stderr


def test_writes_outside_the_private_directory_do_not_reach_the_host(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    if sandbox.uid is None and "filesystem" not in sandbox.enforced:
        pytest.skip("without namespaces or a user of its own the code writes as the trainer")
    targets = [tmp_path / "escaped.txt", Path(sandbox._base).parent / f"escaped-{uuid.uuid4()}"]
    if "filesystem" in sandbox.enforced:  # /tmp itself is read-only for the code
        targets.append(Path("/tmp") / f"rllm-escaped-{uuid.uuid4()}")
    code = (
        "import json, sys\n"
        "errors = []\n"
        f"for path in {json.dumps([str(t) for t in targets])}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        errors.append(None)\n"
        "    except OSError as e:\n"
        "        errors.append(e.strerror)\n"
        "print(json.dumps(errors))"
    )
    result = run(sandbox, code)
    errors = json.loads(result.stdout)
    assert all(errors), errors
    assert not any(t.exists() for t in targets)


def test_the_network_is_unreachable(sandbox: Sandbox) -> None:
    if "network" not in sandbox.enforced:
        pytest.skip("rlimits alone do not cut the network")
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "print([name for _, name in socket.if_nameindex()])\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=2)"
        )
        result = run(sandbox, code)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host's listener
    assert result.stdout == "['lo']\n"  # no interface but its own, down, loopback
    assert result.exit_code == 1 and "Error" in result.stderr


def test_the_code_cannot_see_or_signal_the_hosts_processes(sandbox: Sandbox) -> None:
    if "pids" not in sandbox.enforced:
        pytest.skip("without a PID namespace the host's processes are visible")
    code = "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    result = run(sandbox, code)
    assert json.loads(result.stdout) == [1, 2]  # the launcher and the code itself


def test_runs_after_hostile_ones_start_clean(sandbox: Sandbox) -> None:
    async def main() -> list[SandboxResult]:
        bomb = sandbox.run("import os\nwhile True:\n    os.fork()")
        hog = sandbox.run("x = bytearray(2**40)")
        ok = sandbox.run("import os\nprint(os.listdir('.'))")
        return [await bomb, await hog, await ok]

    *_, ok = asyncio.run(main())
    assert ok.ok and ok.stdout == "[]\n"


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError):
        SandboxLimits(max_output_bytes=10, output_limit_bytes=5)
