"""The PolicyClient of the Tinker backend: one snapshot sampler per live policy version."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from rllm_async.backends import base
from rllm_async.backends.tinker import sdk
from rllm_async.backends.tinker.tokenizer import HFTokenizer


class TinkerPolicy:
    """Samples with logprobs from weight snapshots, keyed by policy version.

    Each `on_policy_updated` publishes a new snapshot sampler. A version stays live while it is the
    newest or while `acquire` holds it; a released, superseded version's sampler is dropped.
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
        """Make `sampler` the newest weights, as `version`."""
        previous, self.latest = self.latest, version
        self._samplers[version] = sampler
        self._prune(previous)

    @property
    def live_versions(self) -> list[int]:
        return sorted(self._samplers)

    async def generate(
        self, prompt_ids: list[int], params: base.SamplingParams, *, version: int | None = None
    ) -> base.Completion:
        await self._start()
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
        ids, logprobs, reason = await sdk.sample(
            sampler, prompt_ids, self._sdk_params(params), self._timeout_s
        )
        return base.Completion(
            ids, logprobs, [v] * len(ids), "length" if reason == "length" else "stop"
        )

    def _sdk_params(self, params: base.SamplingParams) -> Any:
        """Stop at the eos token, and at `params.stop` strings (with eos as a string) if any."""
        tok = self._tokenizer
        stop: list[int] | list[str] = (
            [*params.stop, tok.eos_token] if params.stop else [tok.eos_token_id]
        )
        return sdk.sampling_params(
            params.max_tokens, params.temperature, params.top_p, params.seed, stop
        )

    def _prune(self, version: int) -> None:
        if version != self.latest and version not in self._holds:
            self._samplers.pop(version, None)
