"""The PolicyClient of the Tinker backend: one snapshot sampler per live policy version."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from rllm_async import protocols
from rllm_async.backends.hf_tokenizer import HFTokenizer
from rllm_async.backends.tinker import sdk


class TinkerPolicy:
    """Samples with logprobs from weight snapshots, keyed by policy version.

    Each `on_policy_updated` publishes a new snapshot sampler. A version stays live while it is the
    newest or while `acquire` holds it; a released, superseded version's sampler is dropped.

    Without server snapshots (SkyRL's server: a sampler samples whatever the training adapter holds,
    and its first call loads its saved weights back into it), only the newest version is sampled,
    and the weights must not change under a sample call: the backend calls `freeze()` before each
    optimizer step, which stops new calls and waits for those in flight, and the next `publish`
    lets them go on. So the version a completion is tagged with is the one whose weights the server
    held from the request to the answer, exactly.
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        start: Callable[[], Awaitable[None]],
        timeout_s: float,
        snapshots: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._snapshots = snapshots
        self._start = start
        self._timeout_s = timeout_s
        self._samplers: dict[int, Any] = {}
        self._holds: dict[int, int] = {}
        self.latest = 0
        # Without snapshots: sample calls in flight, and whether new ones must wait (`freeze`).
        self._in_flight = 0
        self._frozen = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open = asyncio.Event()  # set unless frozen
        self._idle = asyncio.Event()  # set when no sample call is in flight

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tokenizer

    def acquire(self) -> int:
        self._holds[self.latest] = self._holds.get(self.latest, 0) + 1
        return self.latest

    def release(self, version: int) -> None:
        held = self._holds.get(version, 0)
        if held <= 0:
            raise ValueError(f"release({version}) without a matching acquire()")
        if held == 1:
            del self._holds[version]
            self._prune(version)
        else:
            self._holds[version] = held - 1

    def publish(self, version: int, sampler: Any) -> None:
        """Make `sampler` the newest weights, as `version` (and let frozen sampling go on)."""
        previous, self.latest = self.latest, version
        self._samplers[version] = sampler
        self._prune(previous)
        self.thaw()

    async def freeze(self) -> None:
        """Without snapshots: stop new sample calls and wait for those in flight (the weights are
        about to change) until `publish` or `thaw`. With snapshots, nothing to do."""
        if self._snapshots:
            return
        self._events()
        self._frozen = True
        self._open.clear()
        if self._in_flight:
            try:
                await asyncio.wait_for(self._idle.wait(), self._timeout_s)
            except TimeoutError:
                self.thaw()
                raise sdk.TinkerBackendError(
                    f"sample calls still running after {self._timeout_s:.0f}s "
                    "(backend.request_timeout_s) before an optimizer step"
                ) from None

    def thaw(self) -> None:
        """Let sample calls go on (after `freeze`)."""
        self._frozen = False
        if self._loop is not None:
            self._open.set()

    @property
    def live_versions(self) -> list[int]:
        return sorted(self._samplers)

    async def generate(
        self, prompt_ids: list[int], params: protocols.SamplingParams, *, version: int | None = None
    ) -> protocols.Completion:
        await self._start()
        if self._frozen:
            self._events()
            try:
                await asyncio.wait_for(self._open.wait(), self._timeout_s)
            except TimeoutError:
                raise sdk.TinkerBackendError(
                    f"sampling waited {self._timeout_s:.0f}s (backend.request_timeout_s) for an "
                    "optimizer step and weight sync to finish"
                ) from None
        v = self.latest if version is None else version
        sampler = self._samplers.get(v)
        if not self._snapshots and v != self.latest:
            raise RuntimeError(
                f"policy version {v} is older than the newest ({self.latest}) and this server's "
                "samplers are not snapshots (backend.server_snapshots: false): sampling it would "
                "overwrite the trained weights"
            )
        if sampler is None:
            raise KeyError(
                f"policy version {v} is not live (live: {self.live_versions}); "
                "acquire() a version to keep its weights until release()"
            )
        if not self._snapshots:
            self._events()
            self._in_flight += 1
            self._idle.clear()
        try:
            ids, logprobs, reason = await sdk.sample(
                sampler, prompt_ids, self._sdk_params(params), self._timeout_s
            )
        finally:
            if not self._snapshots:
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle.set()
        return protocols.Completion(
            ids, logprobs, [v] * len(ids), "length" if reason == "length" else "stop"
        )

    def _sdk_params(self, params: protocols.SamplingParams) -> Any:
        """Stop at the eos token, and at `params.stop` strings (with eos as a string) if any."""
        tok = self._tokenizer
        stop: list[int] | list[str] = (
            [*params.stop, tok.eos_token] if params.stop else [tok.eos_token_id]
        )
        return sdk.sampling_params(
            params.max_tokens, params.temperature, params.top_p, params.seed, stop
        )

    def _events(self) -> None:
        """Bind the freeze events to the running loop (a backend may outlive one loop)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop = loop
            self._open, self._idle = asyncio.Event(), asyncio.Event()
            if not self._frozen:
                self._open.set()
            if not self._in_flight:
                self._idle.set()

    def _prune(self, version: int) -> None:
        if version != self.latest and version not in self._holds:
            self._samplers.pop(version, None)
