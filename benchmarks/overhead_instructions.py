"""Instructions per episode through the whole trainer, counted by valgrind: the throughput part of
`benchmarks/overhead.py` (zero-latency sim workflows and backend, `--in-flight` rollouts admitted)
on the virtual clock, where wall times on a shared machine spread by 20% and this count repeats
within a few instructions (within about 0.1% across environments, whose sizes move the heap).

Prints one JSON line: `instructions_per_episode`, the count of `--steps` steps less that of one
step (start-up, the first step and writing the run's files cancel out) over the episodes between;
`bare_task_instructions`, the same for a task that only awaits five nested coroutines, made eight
at a time in a task group as a dispatch makes a group's rollouts (what asyncio alone costs a
rollout); their ratio, `episode_in_bare_tasks`, which depends less on the CPU and the Python than
either; and the Python that ran them. The count is made repeatable by the virtual clock (the
schedule does not depend on timing), the garbage collector off (its passes land at allocation
thresholds), `PYTHONHASHSEED=0`, no address randomization (`setarch -R`) and one BLAS thread. It
cannot see system calls or cache misses: compare it across changes, and confirm with whole runs
of `overhead.py`.

Needs valgrind and setarch (util-linux) on PATH; valgrind slows Python about 50 times, so the
defaults take a few minutes.

Usage: python benchmarks/overhead_instructions.py [--steps 5] [--in-flight 16384] [--python PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from overhead import GROUP_SIZE, throughput_config  # beside this script

from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run

_DETERMINISTIC_ENV = {
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def fit(steps: int, in_flight: int) -> None:
    """The counted work: `steps` steps of the throughput part on the virtual clock."""
    gc.disable()
    with tempfile.TemporaryDirectory() as tmp:
        run(UnifiedTrainer(throughput_config(tmp, steps, in_flight)).fit(), virtual=True)


async def _nested(depth: int) -> int:
    return await _nested(depth - 1) if depth > 1 else 0


async def _bare_tasks(n: int) -> None:
    async with asyncio.TaskGroup() as group:
        for _ in range(n // GROUP_SIZE):
            for _ in range(GROUP_SIZE):
                group.create_task(_nested(5))
            await asyncio.sleep(0)


def bare_tasks(steps: int, in_flight: int) -> None:
    """The reference: as many bare tasks as `steps` steps have episodes, on the virtual clock."""
    gc.disable()
    run(_bare_tasks(steps * (in_flight // 2)), virtual=True)


def count(python: str, steps: int, in_flight: int, work: str) -> int:
    """Instructions valgrind counts in a child `python` running `work` (`fit` or `bare_tasks`)
    for `steps` steps of `in_flight`."""
    command = [
        "setarch",
        "-R",
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
        python,
        __file__,
        f"--{work.replace('_', '-')}",
        str(steps),
        "--in-flight",
        str(in_flight),
    ]
    env = {**os.environ, **_DETERMINISTIC_ENV}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode or found is None:
        raise SystemExit(f"the counted run failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps counted, one less compared")
    parser.add_argument("--in-flight", type=int, default=16384, help="rollouts in flight at once")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to count")
    parser.add_argument("--fit", type=int, help=argparse.SUPPRESS)  # what a child counts
    parser.add_argument("--bare-tasks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit is not None:
        fit(args.fit, args.in_flight)
        return
    if args.bare_tasks is not None:
        bare_tasks(args.bare_tasks, args.in_flight)
        return
    if args.steps < 2:
        parser.error("--steps must be at least 2: one step is the baseline")
    if args.in_flight < 8 * GROUP_SIZE or args.in_flight % (8 * GROUP_SIZE):
        parser.error(f"--in-flight must be a positive multiple of {8 * GROUP_SIZE}")
    missing = [tool for tool in ("valgrind", "setarch") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"{' and '.join(missing)} not found: install valgrind and util-linux")
    version = subprocess.run(
        [args.python, "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    episodes = (args.steps - 1) * (args.in_flight // 2)
    per = {
        work: (
            count(args.python, args.steps, args.in_flight, work)
            - count(args.python, 1, args.in_flight, work)
        )
        / episodes
        for work in ("fit", "bare_tasks")
    }
    print(
        json.dumps(
            {
                "python": version,
                "in_flight": args.in_flight,
                "episodes_counted": episodes,
                "instructions_per_episode": round(per["fit"]),
                "bare_task_instructions": round(per["bare_tasks"]),
                "episode_in_bare_tasks": round(per["fit"] / per["bare_tasks"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
