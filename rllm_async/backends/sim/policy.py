"""SimPolicy: the PolicyClient of the sim backend, decoding on the simulated inference server."""

from __future__ import annotations

import asyncio
import math
import random
from bisect import bisect_right

from rllm_async.backends.sim.constrained import ConstrainedSampler
from rllm_async.backends.sim.options import SimOptions
from rllm_async.backends.sim.server import ProcessorSharing
from rllm_async.backends.toy_tokenizers import ByteTokenizer
from rllm_async.protocols import Completion, SamplingParams


class SimPolicy:
    """A PolicyClient without a model: decodes exactly `max_tokens` tokens in simulated time.

    Token ids are 0 and logprobs -1.0. Tokens carry the version that produced them: the pinned
    one, or, with `version=None`, the versions in force while each token was decoded.

    Under a constraint (`SamplingParams.structured`) the reply satisfies it: bytes drawn under
    llguidance's masks (`constrained.py`; deterministic per `params.seed`, else per request in
    order), ending with the end of sequence, or cut at `max_tokens`; each of its tokens adds
    `mask_s` seconds of mask computation to its sequence.
    """

    constrains_decoding = True

    def __init__(self, opts: SimOptions) -> None:
        self.mask_s = opts.mask_s
        self._constrained: ConstrainedSampler | None = None  # built at the first constraint
        self._constrained_requests = 0
        self.engine = (
            ProcessorSharing(opts.rmax, opts.n_half, opts.slots) if opts.latency == "ps" else None
        )
        self._tokenizer = ByteTokenizer()
        self._version = 0
        self._refs: dict[int, int] = {}
        # Service levels at which the version changed, for per-token versions in latest mode.
        self._change_levels = [0.0]
        self._change_versions = [0]
        self._closed = False

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    @property
    def version(self) -> int:
        return self._version

    @property
    def snapshots(self) -> dict[int, int]:
        """Acquired snapshots still held: version -> refcount (empty when nothing leaks)."""
        return dict(self._refs)

    def acquire(self) -> int:
        self._refs[self._version] = self._refs.get(self._version, 0) + 1
        return self._version

    def release(self, version: int) -> None:
        held = self._refs.get(version, 0)
        if held <= 0:
            raise ValueError(f"release({version}) without a matching acquire()")
        if held > 1:
            self._refs[version] = held - 1
        else:
            del self._refs[version]

    def set_version(self, version: int) -> None:
        """Serve `version` from now on; sequences still decoding switch to it mid-way."""
        self._version = version
        if self.engine is not None:
            self._change_levels.append(self.engine.level())
            self._change_versions.append(version)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion:
        if self._closed:
            raise RuntimeError("the sim backend is closed")
        if version is not None and version != self._version and version not in self._refs:
            raise ValueError(f"generate(version={version}): snapshot not held; acquire() it first")
        n = max(0, params.max_tokens)
        ids, logprobs, finish = [0] * n, [-1.0] * n, "stop"
        if params.structured is not None:
            ids, logprobs, finish = self._constrained_reply(params, n)
            n = len(ids)
        if self.engine is None or n == 0:
            versions = [self._version if version is None else version] * n
        else:
            job = self.engine.submit(n)
            try:
                await job.done
            finally:
                self.engine.cancel(job)
            versions = [version] * n if version is not None else self._token_versions(job.start, n)
            if params.structured is not None and self.mask_s > 0:
                await asyncio.sleep(n * self.mask_s)
        return Completion(ids=ids, logprobs=logprobs, versions=versions, finish_reason=finish)

    def _constrained_reply(
        self, params: SamplingParams, n: int
    ) -> tuple[list[int], list[float], str]:
        assert params.structured is not None
        seed = params.seed if params.seed is not None else self._constrained_requests
        self._constrained_requests += 1
        return self._constrained_sampler().reply(params.structured, n, random.Random(seed))

    def _constrained_sampler(self) -> ConstrainedSampler:
        """The grammar engine of the sim's vocabulary, built at the first constraint."""
        if self._constrained is None:
            self._constrained = ConstrainedSampler(self._tokenizer)
        return self._constrained

    def _token_versions(self, start: float, n: int) -> list[int]:
        # Token k is emitted when the level reaches start + k + 1; a change at level L reaches
        # the tokens emitted after it, k >= floor(L - start).
        levels, versions = self._change_levels, self._change_versions
        i = bisect_right(levels, start)
        current, done, out = versions[i - 1], 0, []
        while i < len(levels) and levels[i] < start + n:
            cut = max(done, min(n, math.floor(levels[i] - start + 1e-9)))
            out += [current] * (cut - done)
            current, done, i = versions[i], cut, i + 1
        return out + [current] * (n - done)

    def close(self) -> None:
        if not self._closed and self.engine is not None:
            self.engine.close("the sim backend was closed while generating")
        self._closed = True
