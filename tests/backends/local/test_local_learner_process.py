"""`backend.learner: process`: the same training as on a thread; errors and deaths surface here."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import torch

from rllm_async.backends.local import LocalBackend
from rllm_async.backends.local import policy as policy_module
from rllm_async.backends.local.learner_process import LearnerProcess, LearnerSpec
from rllm_async.backends.local.model import build_model, preset_config
from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.callbacks import Callback
from rllm_async.config import OptimConfig
from rllm_async.trainer import UnifiedTrainer
from rllm_async.types import TrajectoryGroup
from tests.backends.local.test_local_backend import make_config, params, sample_groups
from tests.fakes import ctrl_c_raises


def sampler_weights(backend: LocalBackend) -> torch.Tensor:
    """The newest snapshot, which the sampler decodes with."""
    _, model = backend.store.get(None)
    return torch.cat([p.flatten() for p in model.parameters()])


def learner_pid(backend: LocalBackend) -> int:
    assert isinstance(backend.learner, LearnerProcess)
    pid = backend.learner.pid
    assert pid is not None
    return pid


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_the_learner_process_trains_as_the_learner_thread_does(kl_coef: float) -> None:
    algorithm = {"loss": {"kl_coef": kl_coef, "opsm_kl_threshold": 0.5}}
    thread_cfg = make_config(algorithm=algorithm)
    process_cfg = make_config({"learner": "process"}, algorithm=algorithm)
    loss = thread_cfg.algorithm.loss

    async def main() -> None:
        thread = LocalBackend.from_config(thread_cfg)
        process = LocalBackend.from_config(process_cfg)
        start = sampler_weights(process)
        torch.testing.assert_close(start, sampler_weights(thread), rtol=0, atol=0)
        groups = await sample_groups(thread, 3)
        for version in (1, 2):
            metrics = []
            for b in (thread, process):
                metrics.append(
                    [
                        await b.forward_backward(groups[:2], loss),
                        await b.forward_backward(groups[2:], loss),
                        await b.optim_step(),
                    ]
                )
                await b.on_policy_updated(version)
            for on_thread, on_process in zip(*metrics, strict=True):
                assert on_thread.keys() == on_process.keys()
                for key, value in on_thread.items():
                    assert on_process[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
            # The process's new weights reached this process's sampler.
            torch.testing.assert_close(sampler_weights(process), sampler_weights(thread))
        assert not torch.equal(sampler_weights(process), start)
        torch.testing.assert_close(sampler_weights(process), params(thread))
        for b in (thread, process):
            await b.close()

    asyncio.run(main())


def test_checkpoints_move_between_the_learner_process_and_thread(tmp_path: Path) -> None:
    process_cfg = make_config({"learner": "process"})
    loss = process_cfg.algorithm.loss

    async def main() -> None:
        first = LocalBackend.from_config(process_cfg)
        groups = await sample_groups(first, 2)
        await first.forward_backward(groups, loss)
        await first.optim_step()
        await first.on_policy_updated(1)
        await first.save(tmp_path / "ckpt")
        await first.forward_backward(groups, loss)
        expected = await first.optim_step()
        await first.on_policy_updated(2)

        for resumed_cfg in (make_config(), process_cfg):
            resumed = LocalBackend.from_config(resumed_cfg)
            await resumed.load(tmp_path / "ckpt")
            assert resumed.policy().acquire() == 1
            await resumed.forward_backward(groups, loss)
            got = await resumed.optim_step()
            await resumed.on_policy_updated(2)
            assert got["optim/lr"] == expected["optim/lr"]  # the schedule position came along
            assert got["optim/grad_norm"] == pytest.approx(expected["optim/grad_norm"], rel=1e-5)
            torch.testing.assert_close(sampler_weights(resumed), sampler_weights(first))
            await resumed.close()
        await first.close()

    asyncio.run(main())


def test_errors_in_the_learner_process_are_raised_by_the_backend(tmp_path: Path) -> None:
    cfg = make_config({"learner": "process"})

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        groups = await sample_groups(backend, 1)
        with_kl = cfg.algorithm.loss.model_copy(update={"kl_coef": 0.1})
        with pytest.raises(ValueError, match="kl_coef"):
            await backend.forward_backward(groups, with_kl)
        await backend.forward_backward(groups, cfg.algorithm.loss)  # the process lives on
        await backend.save(tmp_path)  # the last step's state; the pending gradients stay
        assert (await backend.optim_step())["optim/num_tokens"] > 0
        await backend.close()

    asyncio.run(main())


@dataclass
class HeldGroups:
    """Groups that hold the learner process inside `forward_backward`: iterating them, the call's
    first work, creates the file `entered` and then sleeps (until the test kills the process)."""

    groups: list[TrajectoryGroup]
    entered: Path

    def __iter__(self) -> Iterator[TrajectoryGroup]:
        self.entered.touch()
        time.sleep(600)
        return iter(self.groups)


KILLED = (
    r"the learner process was killed by SIGKILL \(exit code -9; perhaps it ran out of memory\) "
    r"during forward_backward\(\)\. Set backend\.learner: thread to train in this process"
)


@pytest.mark.parametrize("when", ["between calls", "during a call"])
def test_a_learner_process_killed_fails_its_call_at_once_naming_the_signal(
    when: str, tmp_path: Path
) -> None:
    cfg = make_config({"learner": "process"})
    loss = cfg.algorithm.loss

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        groups = await sample_groups(backend, 1)
        pid = learner_pid(backend)
        if when == "between calls":
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            call = asyncio.ensure_future(backend.forward_backward(groups, loss))
        else:
            entered = tmp_path / "entered"
            held = cast(list[TrajectoryGroup], HeldGroups(groups, entered))
            call = asyncio.ensure_future(backend.forward_backward(held, loss))
            async with asyncio.timeout(60):
                while not entered.exists():
                    await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
        # The bounds only catch a hang: the pipe's end-of-file fails the call once the child is
        # gone (a child that is not noticed leaves it waiting for ever).
        with pytest.raises(RuntimeError, match=KILLED):
            await asyncio.wait_for(call, 60)
        assert time.monotonic() - killed < 60
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped
        with pytest.raises(RuntimeError, match="killed by SIGKILL"):
            await asyncio.wait_for(backend.optim_step(), 10)  # every later call fails too
        await asyncio.wait_for(backend.close(), 30)

    asyncio.run(main())


# Fed on standard input, this program has no file that a spawned process could import as its
# __main__: the learner process dies at start-up.
FROM_STDIN = """
from rllm_async.backends.local import LocalBackend
from rllm_async.config import config_from_dict

LocalBackend.from_config(config_from_dict({"backend": {"name": "local", "learner": "process"}}))
print("built")
"""


def test_a_learner_process_that_dies_at_start_up_says_why_and_how_to_avoid_it(
    tmp_path: Path,
) -> None:
    # The timeout fails a hang (generous: two interpreters import torch, on a loaded machine).
    # The run also ends only once every process holding its stderr is gone, the learner
    # process included.
    run = subprocess.run(
        [sys.executable, "-"],
        input=FROM_STDIN,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert run.returncode == 1
    assert "built" not in run.stdout
    assert "FileNotFoundError" in run.stderr  # the learner process's own error
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith(
        "RuntimeError: the learner process exited with code 1 during start-up. "
        "A spawned learner process first imports the program's __main__ again"
    )
    assert 'under `if __name__ == "__main__":`' in error
    assert error.endswith("or set backend.learner: thread.")


def test_closing_the_backend_stops_the_learner_process() -> None:
    async def main() -> None:
        backend = LocalBackend.from_config(make_config({"learner": "process"}))
        pid = learner_pid(backend)
        os.kill(pid, 0)  # running
        await backend.close()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        await backend.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            await backend.optim_step()

    asyncio.run(main())


def test_the_learner_process_leaves_ctrl_c_to_the_backend() -> None:
    """Ctrl-C reaches the whole process group: the learner must stay up for the backend's own
    shutdown (which may save a checkpoint through it), then stop when the backend closes it."""
    cfg = make_config({"learner": "process"})

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        os.kill(learner_pid(backend), signal.SIGINT)
        await asyncio.sleep(0.2)
        await backend.forward_backward(await sample_groups(backend, 1), cfg.algorithm.loss)
        assert (await backend.optim_step())["optim/num_tokens"] > 0
        await backend.close()

    asyncio.run(main())


class CtrlCAfterAStep(Callback):
    """Ctrl-C once, at the end of the first step: the run has trained when it is interrupted."""

    sent = False

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


def test_an_interrupted_run_stops_its_learner_process(tmp_path: Path) -> None:
    cfg = make_config(
        {"learner": "process"},
        name="interrupted",
        run_dir=str(tmp_path),
        data={
            "train": {
                "generator": "rllm_async.tasks.countdown:generator",
                "args": {"n": 1000, "seed": 0},
            }
        },
        workflow={
            "cls": "rllm_async.workflows.SingleTurnWorkflow",
            "args": {"reward_fn": "rllm_async.tasks.countdown:reward"},
        },
        algorithm={"filter_zero_variance": False},  # an untrained model rarely scores
        train={"total_steps": 10_000, "groups_per_step": 2},
        logging={"progress_bar": False},
    )
    trainer = UnifiedTrainer(cfg, callbacks=[CtrlCAfterAStep()])
    pid = learner_pid(trainer.backend)
    with ctrl_c_raises(), pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert trainer.records, "it trained before the interrupt"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_a_learner_process_that_cannot_start_says_why() -> None:
    spec = LearnerSpec(
        with_ref=False,
        optim=OptimConfig(),
        total_steps=1,
        temperature=1.0,
        train_batch=1,
        compute_dtype=torch.float32,
        device="cuda:0",  # the child cannot put the model there
        threads=1,
    )
    model = build_model(preset_config("tiny", CharTokenizer().vocab_size), seed=0)
    with pytest.raises(Exception, match=r"(?i)cuda|nvidia") as failed:
        LearnerProcess(spec, model)
    assert "exited" not in str(failed.value), "the child's own error, not just its death"


def test_a_backend_that_fails_to_build_leaves_no_learner_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_sampler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the sampler could not start")

    monkeypatch.setattr(policy_module, "Sampler", broken_sampler)
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="could not start"):
        LocalBackend.from_config(make_config({"learner": "process"}))
    assert set(multiprocessing.active_children()) == before
