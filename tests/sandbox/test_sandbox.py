"""The sandbox runs code and returns its output; each run starts from nothing; a failure of the
sandbox itself raises SandboxError, anything the code does is a result."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rllm_async.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxPool, SandboxResult
from tests.sandbox.conftest import LIMITS, Setup


def test_code_runs_and_its_output_comes_back(sandbox: Sandbox) -> None:
    code = "import sys\nprint(sum(range(10)))\nprint('warn', file=sys.stderr)\nraise SystemExit(3)"
    result = asyncio.run(sandbox.run(code))
    assert result.stdout == "45\n" and result.stderr == "warn\n"
    assert result.exit_code == 3 and result.limit is None and not result.ok
    assert result.isolation == sandbox.isolation
    assert result.to_text() == "45\n\nstderr:\nwarn\n\n[exit status 3]"


def test_an_exception_in_the_code_is_a_result_with_its_traceback(sandbox: Sandbox) -> None:
    result = asyncio.run(sandbox.run("1/0"))
    assert result.exit_code == 1 and result.limit is None
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")


def test_each_run_gets_a_fresh_empty_directory_removed_after_it(sandbox: Sandbox) -> None:
    code = (
        "import json, os\n"
        "before = sorted(os.listdir('.'))\n"
        "open('secret.txt', 'w').write('run data')\n"
        "print(json.dumps([os.getcwd(), before]))"
    )

    async def twice() -> list[SandboxResult]:
        return [await sandbox.run(code), await sandbox.run(code)]

    first, second = asyncio.run(twice())
    (dir1, before1), (dir2, before2) = json.loads(first.stdout), json.loads(second.stdout)
    assert before1 == [] and before2 == [], "a run saw what another left"
    assert dir1 != dir2
    assert not Path(dir1).exists() and not Path(dir2).exists()


def test_the_code_sees_none_of_the_trainers_environment(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLLM_TEST_SECRET", "hunter2")
    result = asyncio.run(sandbox.run("import os; print('RLLM_TEST_SECRET' in os.environ)"))
    assert result.stdout == "False\n"


def test_a_sandbox_that_cannot_start_raises_sandbox_error(setup: Setup) -> None:
    missing = str(setup.root_dir / "no-python")
    box = Sandbox(LIMITS, setup.isolation, root_dir=str(setup.root_dir), python=missing)
    with pytest.raises(SandboxError, match="the sandbox failed to start"):
        asyncio.run(box.run("print(1)"))
    asyncio.run(box.close())


def test_code_over_the_size_limit_is_refused_without_running(sandbox: Sandbox) -> None:
    small = Sandbox(SandboxLimits(max_code_bytes=100), sandbox.isolation, python=sandbox.python)
    result = asyncio.run(small.run("print(1)\n" * 100))
    asyncio.run(small.close())
    assert result.limit == "code_size" and result.exit_code is None


def test_the_pool_reuses_its_sandboxes_and_keeps_runs_apart(setup: Setup) -> None:
    code = (
        "import os\n"
        "print(len(os.listdir(os.path.expanduser('~'))))\n"
        "open('left.txt', 'w').write('x')"
    )

    async def main() -> tuple[list[SandboxResult], dict[str, float]]:
        pool = SandboxPool(
            2, LIMITS, setup.isolation, root_dir=str(setup.root_dir), python=setup.python
        )
        async with pool:
            results = [await pool.run(code) for _ in range(3)]
            results += await asyncio.gather(*(pool.run(code) for _ in range(4)))
            return results, pool.metrics()

    results, metrics = asyncio.run(main())
    assert [r.stdout for r in results] == ["0\n"] * 7, "a run saw a file another run wrote"
    assert metrics["runs"] == 7 and metrics["sandboxes"] == 2
    assert metrics["reused"] == 5
    assert metrics[f"isolation/{setup.isolation}"] == 1.0


def test_a_runs_time_is_bounded_by_what_the_episode_has_left(setup: Setup) -> None:
    pool = SandboxPool(
        1,
        SandboxLimits(wall_s=10.0),
        setup.isolation,
        margin_s=0.5,
        root_dir=str(setup.root_dir),
        python=setup.python,
    )
    assert pool.wall_s() == 10.0
    assert pool.wall_s(timeout_s=4.0) == 4.0
    assert pool.wall_s(timeout_s=4.0, time_left_s=3.0) == 2.5
    assert pool.wall_s(time_left_s=0.2) < 0

    async def no_time() -> SandboxResult:
        async with pool:
            return await pool.run("print(1)", time_left_s=0.2)

    result = asyncio.run(no_time())
    assert result.limit == "wall" and result.exit_code is None


def test_the_isolation_in_force_is_said(sandbox: Sandbox) -> None:
    enforced = sandbox.enforced
    assert {"wall", "cpu", "memory", "processes", "output"} <= enforced
    assert ("network" in enforced) == (sandbox.isolation == "namespaces")
    result = asyncio.run(sandbox.run("pass"))
    assert result.ok and result.isolation == sandbox.isolation
