"""The learner on a process of its own (`backend.learner: process`).

On a CPU the sampler thread, the event loop and a training thread share one interpreter lock, and
every op the trainer's forward pass dispatches waits for it: in the main job's runs a step's
forward/backward took 18-27% less time on a process (docs/benchmarks.md). A process has its own lock. The learner is built there
from the starting weights; the backend calls it over a pipe, one call at a time from its training
thread, and for each sampler snapshot the child copies its weights into a buffer in shared memory
that the backend then copies out of (a state dict through the pipe took about 10 ms more a step).
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
from rllm_async.backends.local.model import (
    ModelConfig,
    Transformer,
    frozen_copy,
    hf_weights,
    load_model,
)
from rllm_async.config import LossConfig, OptimConfig
from rllm_async.types import TrajectoryGroup

_CLOSE_TIMEOUT_S = 30.0


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

    def build(self, model: Transformer) -> Learner:
        """The learner, training `model` itself."""
        ref = (
            frozen_copy(model, torch.device(self.device), torch.float32) if self.with_ref else None
        )
        return Learner(
            model,
            self.optim,
            total_steps=self.total_steps,
            temperature=self.temperature,
            train_batch=self.train_batch,
            compute_dtype=self.compute_dtype,
            ref_model=ref,
        )


def _parts(buffer: torch.Tensor, model: Transformer) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each parameter of `model` with its slice of the flat `buffer`, shaped like it."""
    offset = 0
    for p in model.parameters():
        yield p, buffer[offset : offset + p.numel()].view_as(p)
        offset += p.numel()


def _layout(model: Transformer) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


# The calls the backend makes, besides "share_weights" (which needs the shared buffer): nothing
# else crosses the pipe.
_CALLS: dict[str, Callable[..., Any]] = {
    "forward_backward": Learner.forward_backward,
    "optim_step": Learner.optim_step,
    "state_dict": Learner.state_dict,
    "load_state_dict": Learner.load_state_dict,
}


class LearnerProcess:
    """A `Learner` on a child process, with the methods of it that the backend uses.

    Calls block until the child answers; the backend makes them from its one training thread. An
    exception in the child is raised here; a child that dies makes every later call fail with
    its exit code.
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
            target=_serve,
            args=(child, start, self._shared),
            name="rllm-local-learner",
            daemon=True,
        )
        self._process.start()
        child.close()
        self._closed = False
        try:
            self._receive("start-up")  # the child built the learner, or raise why it could not
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

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def copy_weights_to(self, model: Transformer) -> None:
        """Give `model` (shaped as the learner's) the learner's current weights."""
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
        try:
            ok, value = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as e:
            self._process.join(1.0)
            raise RuntimeError(
                f"the learner process exited during {what} (exit code "
                f"{self._process.exitcode}; a negative code is the signal that ended it)"
            ) from e
        if not ok:
            raise value
        return value


def _serve(conn: multiprocessing.connection.Connection, start: bytes, shared: torch.Tensor) -> None:
    """The child: build the learner, then answer calls until told to close or the parent goes."""
    # Ctrl-C reaches the whole process group; the parent decides how to stop (it may still save
    # a checkpoint through this process), then closes it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec: LearnerSpec
    cfg: ModelConfig
    spec, cfg, weights, layout = pickle.loads(start)
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
                    for p, part in _parts(shared, learner.model):
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
