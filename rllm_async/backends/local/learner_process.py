"""The learner on a process of its own (`backend.learner: process`).

On a CPU the sampler thread, the event loop and a training thread share one interpreter lock, and
every op the trainer's forward pass dispatches waits for it: in the main job's runs a step's
forward/backward took 18-27% less time on a process (docs/benchmarks.md). A process has its own lock. The learner is built there
from the starting weights; the backend calls it over a pipe, one call at a time from its training
thread, and for each sampler snapshot the child copies its weights into a buffer in shared memory
that the backend then copies out of (a state dict through the pipe took about 10 ms more a step).

A child that dies, at start-up or later, fails the call waiting on it at once, with its exit code or
signal and what to do about it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import pickle
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rllm_async.backends.local.learner import Learner
from rllm_async.backends.local.lora import LoRA, LoRAOptions
from rllm_async.backends.local.model import (
    ModelConfig,
    Transformer,
    hf_weights,
    load_model,
)
from rllm_async.backends.local.transformers_model import Decoder, inference_copy
from rllm_async.config import LossConfig, OptimConfig
from rllm_async.types import TrajectoryGroup

_CLOSE_TIMEOUT_S = 30.0
_START_UP = "start-up"  # the wait for the learner to be built, in errors


@dataclass(frozen=True)
class LearnerSpec:
    """How to build the backend's `Learner` around a model, here or in the learner process."""

    with_ref: bool  # a frozen copy of the starting weights as the KL reference
    optim: OptimConfig
    total_steps: int
    temperature: float
    train_batch: int
    compute_dtype: torch.dtype
    device: str
    threads: int
    lora: LoRAOptions | None = None  # train adapters on the frozen model instead of the model
    seed: int = 0  # the adapters' initialisation
    updates_per_batch: int = 1  # optimizer steps per batch, for recomputed old logprobs
    # The sampler's tokenizer and stop ids: the learner replays constrained tokens' grammar masks.
    tokenizer: Any = None
    stop_ids: tuple[int, ...] = ()

    def build(self, model: Decoder) -> Learner:
        """The learner, training `model` itself or, with `lora`, adapters on it."""
        ref = (
            inference_copy(model, torch.device(self.device), torch.float32)
            if self.with_ref
            else None
        )
        lora = None
        if self.lora is not None:
            assert isinstance(model, Transformer)  # the backend refuses LoRA on the fallback
            lora = LoRA(model, self.lora, self.seed)
        return Learner(
            model,
            self.optim,
            total_steps=self.total_steps,
            temperature=self.temperature,
            train_batch=self.train_batch,
            compute_dtype=self.compute_dtype,
            ref_model=ref,
            lora=lora,
            updates_per_batch=self.updates_per_batch,
            tokenizer=self.tokenizer,
            stop_ids=self.stop_ids,
        )


def _parts(
    buffer: torch.Tensor, model: torch.nn.Module
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each parameter of `model` with its slice of the flat `buffer`, shaped like it."""
    offset = 0
    for p in model.parameters():
        yield p, buffer[offset : offset + p.numel()].view_as(p)
        offset += p.numel()


def _layout(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


# The calls the backend makes, besides "share_weights" (which needs the shared buffer): nothing
# else crosses the pipe.
_CALLS: dict[str, Callable[..., Any]] = {
    "forward_backward": Learner.forward_backward,
    "optim_step": Learner.optim_step,
    "record_old_logprobs": Learner.record_old_logprobs,
    "state_dict": Learner.state_dict,
    "load_state_dict": Learner.load_state_dict,
}


class LearnerProcess:
    """A `Learner` on a child process, with the methods of it that the backend uses.

    Calls block until the child answers, however long that takes; the backend makes them from its
    one training thread. An exception in the child is raised here; a child that dies fails the call
    waiting on it and every later one with a `RuntimeError` naming its exit code or signal.
    """

    def __init__(self, spec: LearnerSpec, model: Transformer) -> None:
        """Start the child with `spec` and a copy of `model`'s weights."""
        weights = {name: w.detach().cpu().clone() for name, w in hf_weights(model).items()}
        start = pickle.dumps((spec, model.cfg, weights, _layout(model)))
        # The weights' way back; multiprocessing passes it to the child as shared memory.
        self._shared = torch.empty(sum(p.numel() for p in model.parameters())).share_memory_()
        # spawn, not fork: the parent already runs threads (torch's, the sampler's), and a forked
        # child would inherit their locks in whatever state they were in.
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve, args=(child, self._shared), name="rllm-local-learner", daemon=True
        )
        self._process.start()
        child.close()  # the child's end is the child's alone: its death closes the pipe
        self._closed = False
        try:
            # The weights go over the pipe, not with the process: `start()` writes its arguments
            # to the new process while holding that pipe's read end itself, so a child that dies
            # before reading more than a pipe's buffer (64 KiB) of them would block it for ever.
            with contextlib.suppress(OSError):  # a dead child is reported by _receive
                self._conn.send_bytes(start)
            self._receive(_START_UP)  # the child built the learner, or raise why it could not
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def forward_backward(self, groups: list[TrajectoryGroup], loss: LossConfig) -> dict[str, float]:
        return self._call("forward_backward", groups, loss)

    def optim_step(self) -> dict[str, float]:
        return self._call("optim_step")

    def record_old_logprobs(self, groups: list[TrajectoryGroup]) -> None:
        self._call("record_old_logprobs", groups)

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def copy_weights_to(self, model: Transformer) -> None:
        """Give `model` (shaped as the learner's) the learner's current weights, adapters merged."""
        self._call("share_weights")
        with torch.no_grad():
            for p, part in _parts(self._shared, model):
                p.copy_(part)

    def close(self) -> None:
        """Stop the child and wait for it; idempotent, and safe after the child died."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):  # the child may be gone already
            self._conn.send_bytes(pickle.dumps(("close", ())))
        self._process.join(_CLOSE_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _call(self, name: str, *args: Any) -> Any:
        if self._closed:
            raise RuntimeError("the learner process is closed")
        # Plain pickles: tensors cross as copies (multiprocessing's own pickler would move them,
        # the live parameters included, to shared memory).
        with contextlib.suppress(OSError):  # a dead child is reported by _receive
            self._conn.send_bytes(pickle.dumps((name, args)))
        return self._receive(f"{name}()")

    def _receive(self, what: str) -> Any:
        """The child's answer to `what` (raised if an error), waiting as long as the child lives.

        The child's end of the pipe is open in the child alone, so its death, whenever it comes,
        ends the wait here with end-of-file.
        """
        try:
            ok, value = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            raise self._death(what) from None
        if not ok:
            raise value
        return value

    def _death(self, what: str) -> RuntimeError:
        """Why the child, which closed the pipe by exiting, failed `what`, and what to do; reaps it."""
        self._process.join()
        code = self._process.exitcode
        assert code is not None
        if code < 0:
            cause = f"was killed by {_signal_name(-code)} (exit code {code}"
            cause += "; perhaps it ran out of memory)" if -code == signal.SIGKILL else ")"
        else:
            cause = f"exited with code {code}"
        if what == _START_UP and code >= 0:
            fix = (
                "A spawned learner process first imports the program's __main__ again (its error is "
                "printed above), so the program must be a file that can be imported, with its work "
                'under `if __name__ == "__main__":` (not a script read from standard input); or '
                "set backend.learner: thread."
            )
        else:
            fix = "Set backend.learner: thread to train in this process instead."
        return RuntimeError(f"the learner process {cause} during {what}. {fix}")


def _signal_name(number: int) -> str:
    """SIGKILL for 9."""
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name of its own
        return f"signal {number}"


def _serve(conn: multiprocessing.connection.Connection, shared: torch.Tensor) -> None:
    """The child: build the learner, then answer calls until told to close or the parent goes."""
    # Ctrl-C reaches the whole process group; the parent decides how to stop (it may still save
    # a checkpoint through this process), then closes it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec: LearnerSpec
    cfg: ModelConfig
    try:
        spec, cfg, weights, layout = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return  # the parent is gone
    torch.set_num_threads(spec.threads)
    try:
        learner = spec.build(load_model(cfg, weights, torch.device(spec.device), torch.float32))
        if _layout(learner.model) != layout:
            raise RuntimeError("the learner process built its model with another layout")
    except Exception as e:
        _answer(conn, False, e)
        return
    _answer(conn, True, None)
    while True:
        try:
            name, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        if name == "close":
            return
        try:
            if name == "share_weights":
                with torch.no_grad():
                    for p, part in _parts(shared, learner.merged_model()):
                        part.copy_(p)
                result = None
            else:
                result = _CALLS[name](learner, *args)
        except Exception as e:  # raised again in the parent
            _answer(conn, False, e)
        else:
            _answer(conn, True, result)


def _answer(conn: multiprocessing.connection.Connection, ok: bool, value: Any) -> None:
    try:
        data = pickle.dumps((ok, value))
    except Exception:  # an exception that does not pickle: its type and message do
        data = pickle.dumps((False, RuntimeError(f"{type(value).__name__}: {value}")))
    conn.send_bytes(data)
