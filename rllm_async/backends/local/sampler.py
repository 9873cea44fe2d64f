"""Dynamic-batching sampler: one background thread decodes every pending request together.

Requests from many asyncio workflows join the batch between decode steps and leave it as soon as
they finish; each occupies one slot of a KV cache. Requests on different weight versions (pinned
episodes) share the cache but are decoded in one forward pass per version. Free slots go to queued
requests in arrival order, each priority value counting as an arrival `PRIORITY_DELAY_S` later: a
request of priority 1 (an evaluation beside training) lets rollouts that come within that time go
first, and is never starved by a steady stream of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import random
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rllm_async.backends.local.cache import KVCache
from rllm_async.backends.local.snapshots import WeightStore
from rllm_async.backends.local.transformers_model import Decoder, TokenCache, TransformersModel
from rllm_async.grammar import ConstraintError, Grammars, apply_bitmask
from rllm_async.protocols import Completion, SamplingParams, Tokenizer

# How much later than its arrival a queued request of priority 1 ranks (2 for priority 2...):
# longer than a rollout's model call usually waits for a slot, short next to an evaluation.
PRIORITY_DELAY_S = 2.0


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    max_new: int
    pinned: tuple[int, Decoder] | None  # a version and its weights; None: newest each step
    rng: random.Random  # this request's own stream: its samples do not depend on its batch-mates
    matcher: Any  # the constraint's `llguidance.LLMatcher`, advanced by each token; None: free
    # Resolved on its caller's loop (`_deliver`). The decode thread only asks `cancelled()`, one
    # read of its state: a cancel it misses is seen at the next step.
    future: asyncio.Future[Completion]
    slot: int = -1
    reason: str = "stop"  # why it ended, unless `error` is set
    error: Exception | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def next_position(self) -> int:
        """Where the last sampled token goes in the cache."""
        return len(self.prompt) + len(self.ids) - 1


class Sampler:
    """Samples completions from the weights in a `WeightStore`, batching concurrent requests.

    Logprobs are those of the distribution tokens were drawn from after temperature and before
    top-p (the unscaled model at temperature 0), so a trainer that divides its logits by the same
    temperature reproduces them. Under a constraint, that distribution is the masked one,
    renormalized over the tokens the grammar allows; the learner applies the same masks.
    """

    def __init__(
        self,
        store: WeightStore,
        tokenizer: Tokenizer,
        stop_ids: Sequence[int],
        *,
        max_batch: int,
        max_seq_len: int,
        device: torch.device,
        dtype: torch.dtype,
        threads: int,
        seed: int,
    ) -> None:
        model = store.get(None)[1]
        self.store = store
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self._stop_ids = frozenset(stop_ids)
        self._device = device
        self._threads = threads
        self._seeds = random.Random(seed)
        self._stop_list = list(stop_ids)
        self._grammars: Grammars | None = None  # made at the first constrained request
        self._vocab_size = model.vocab_size
        # Keys and values for our decoder; a transformers model reruns each slot's token ids.
        self._cache: KVCache | TokenCache
        if isinstance(model, TransformersModel):
            self._cache = TokenCache(max_batch, max_seq_len, device)
        else:
            self._cache = KVCache(
                n_layers=model.cfg.n_layers,
                max_batch=max_batch,
                n_kv_heads=model.cfg.kv_heads,
                max_seq_len=max_seq_len,
                head_dim=model.cfg.hdim,
                device=device,
                dtype=dtype,
            )
        self._free = list(range(max_batch))
        self.peak_batch = 0  # most requests decoded in one step, for tests and benchmarks
        # Queued requests by (arrival time + priority delay, arrival number).
        self._pending: list[tuple[float, int, _Request]] = []
        self._arrivals = itertools.count()
        self._active: list[_Request] = []
        self._ended: list[_Request] = []  # for `_deliver`
        self._wake = threading.Condition()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rllm-local-sampler", daemon=True)
        self._thread.start()
        # Also stops the thread at interpreter exit: torch aborts the process if a daemon thread
        # is still inside an op when the interpreter tears down.
        self._stopper = weakref.finalize(self, _stop, self._wake, self._closed, self._thread)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, version: int | None = None
    ) -> Completion:
        """Queue one request and wait for its completion."""
        if not prompt_ids:
            raise ValueError("generate() needs at least one prompt token")
        room = self.max_seq_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room in max_seq_len "
                f"{self.max_seq_len}: shorten the prompt or raise backend.max_seq_len"
            )
        # A new constraint compiles here, on a worker thread (llguidance releases the GIL), not on
        # the decode thread: a new schema never stalls the batch. A bad one raises
        # `ConstraintError`. A constraint seen before starts as a copy of its first matcher.
        matcher = None
        if params.structured is not None:
            grammars = self._grammars
            if grammars is None:
                grammars = await asyncio.to_thread(self.grammars)
            if grammars.compiled(params.structured):
                matcher = grammars.matcher(params.structured)
            else:
                matcher = await asyncio.to_thread(grammars.matcher, params.structured)
        pinned = self.store.get(version) if version is not None else None
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        future = asyncio.get_running_loop().create_future()
        request = _Request(
            prompt=list(prompt_ids),
            params=params,
            max_new=min(params.max_tokens, room),
            pinned=pinned,
            rng=random.Random(seed),
            matcher=matcher,
            future=future,
        )
        with self._wake:
            if self._closed.is_set():
                raise RuntimeError("the sampler is closed")
            rank = time.monotonic() + params.priority * PRIORITY_DELAY_S
            heapq.heappush(self._pending, (rank, next(self._arrivals), request))
            self._wake.notify()
        return await future

    def grammars(self) -> Grammars:
        """The grammar engine over this sampler's tokenizer and vocabulary (made once)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self._vocab_size, self._stop_list)
        return self._grammars

    def close(self) -> None:
        """Stop the decode thread and fail whatever is still queued or running; idempotent."""
        self._stopper()

    def _loop(self) -> None:
        torch.set_num_threads(self._threads)
        while True:
            with self._wake:
                while not self._closed.is_set() and not self._pending and not self._active:
                    self._wake.wait()
                if self._closed.is_set():
                    break
                joiners = []
                while self._pending and self._free:
                    request = heapq.heappop(self._pending)[2]
                    if not request.future.cancelled():
                        request.slot = heapq.heappop(self._free)  # lowest first: compact
                        joiners.append(request)
            try:
                with torch.inference_mode():
                    self._prefill(joiners)
                    self._decode()
            except Exception as e:  # never let one bad step kill the thread other callers wait on
                for request in [*joiners, *self._active]:
                    self._finish(request, error=e)
                self._active = []
            self._deliver()
        with self._wake:
            leftover = [*(queued[2] for queued in self._pending), *self._active]
            self._pending.clear()
        for request in leftover:
            self._finish(request, error=RuntimeError("the sampler was closed"))
        self._deliver()

    def _prefill(self, joiners: list[_Request]) -> None:
        """Run the prompts of newly admitted requests and sample their first tokens.

        A group's samples arrive together with the same prompt: each distinct prompt runs once
        and its keys and values are copied into the slots of the requests that share it.
        """
        for version, model, group in self._by_weights(joiners):
            leaders: dict[tuple[int, ...], int] = {}  # prompt -> row of the request that runs it
            rows = [leaders.setdefault(tuple(r.prompt), len(leaders)) for r in group]
            unique = [group[rows.index(i)] for i in range(len(leaders))]
            lengths = torch.tensor([len(r.prompt) for r in unique])
            width = int(lengths.max())
            tokens = torch.zeros(len(unique), width, dtype=torch.long)
            for row, request in enumerate(unique):
                tokens[row, : len(request.prompt)] = torch.tensor(request.prompt)
            positions = torch.arange(width).expand(len(unique), width)
            logits = self._forward(model, unique, tokens, positions, last=lengths - 1)
            for request, row in zip(group, rows, strict=True):
                if request is not unique[row]:
                    self._cache.copy(unique[row].slot, request.slot, len(request.prompt))
            self._step(group, logits[rows], version)
            self.peak_batch = max(self.peak_batch, len(group))
            self._active.extend(r for r in group if r.slot >= 0)

    def _decode(self) -> None:
        """Feed every active request its last token and sample the next one."""
        self.peak_batch = max(self.peak_batch, len(self._active))
        for version, model, group in self._by_weights(self._active):
            tokens = torch.tensor([[r.ids[-1]] for r in group])
            positions = torch.tensor([[r.next_position] for r in group])
            logits = self._forward(
                model, group, tokens, positions, last=torch.zeros_like(positions[:, 0])
            )
            self._step(group, logits, version)
        # A request holds its slot until `_finish`; a caller's cancel only marks the future, and the
        # next `_step` sees it, so filter on the slot, not on the future.
        self._active = [r for r in self._active if r.slot >= 0]

    def _forward(
        self,
        model: Decoder,
        group: list[_Request],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        last: torch.Tensor,
    ) -> torch.Tensor:
        """Run `tokens` through the cache slots of `group`; logits [B, vocab] at column `last[b]`."""
        slots = torch.tensor([r.slot for r in group], device=self._device)
        view: Any = self._cache.view(slots, positions.to(self._device))
        hidden = model.hidden(tokens.to(self._device), view)
        rows = torch.arange(len(group), device=self._device)
        return model.lm_head(hidden[rows, last.to(self._device)]).float().cpu()

    def _by_weights(self, requests: list[_Request]) -> list[tuple[int, Decoder, list[_Request]]]:
        """Split requests by the weights they decode with this step."""
        groups: dict[int, tuple[Decoder, list[_Request]]] = {}
        for r in requests:
            version, model = r.pinned if r.pinned is not None else self.store.get(None)
            groups.setdefault(version, (model, []))[1].append(r)
        # Slot order lets the cache read a batch's history as one view instead of a gather.
        return [(v, model, sorted(group, key=_slot)) for v, (model, group) in groups.items()]

    def _step(self, group: list[_Request], logits: torch.Tensor, version: int) -> None:
        """Sample one token per request from its row of `logits` and finish those that are done."""
        live = [i for i, r in enumerate(group) if not r.future.cancelled()]
        for request in (r for r in group if r.future.cancelled()):
            self._finish(request)
        if not live:
            return
        requests = [group[i] for i in live]
        logits = self._constrain(requests, logits[live])
        failed = [
            i for i, r in enumerate(requests) if r.matcher is not None and r.matcher.is_error()
        ]
        if failed:  # the grammar engine gave up (a resource limit): only those requests fail
            for i in failed:
                error = ConstraintError(
                    f"constrained decoding failed: {requests[i].matcher.get_error()}"
                )
                self._finish(requests[i], error=error)
            keep = [i for i in range(len(requests)) if i not in failed]
            requests, logits = [requests[i] for i in keep], logits[keep]
            if not requests:
                return
        tokens, logprobs = sample_tokens(
            logits, [r.params for r in requests], [r.rng.random() for r in requests]
        )
        for request, token, logprob in zip(requests, tokens, logprobs, strict=True):
            if request.matcher is not None:
                request.matcher.consume_token(token)
            request.ids.append(token)
            request.logprobs.append(logprob)
            request.versions.append(version)
            reason = self._finish_reason(request)
            if reason is not None:
                self._finish(request, reason=reason)

    def _constrain(self, requests: list[_Request], logits: torch.Tensor) -> torch.Tensor:
        """`logits` with each constrained request's row masked to what its grammar allows next."""
        rows = [i for i, r in enumerate(requests) if r.matcher is not None]
        if not rows:
            return logits
        grammars = self.grammars()
        bitmask = grammars.new_bitmask(len(rows))
        for k, i in enumerate(rows):
            grammars.fill(requests[i].matcher, bitmask, k)
        index = torch.tensor(rows)
        return logits.index_copy(0, index, apply_bitmask(logits[index], bitmask))

    def _finish_reason(self, request: _Request) -> str | None:
        if request.ids[-1] in self._stop_ids:
            return "stop"
        for stop in request.params.stop:
            # A stop string that just appeared overlaps the newest token and spans at most
            # len(stop) tokens, so only that tail needs decoding.
            if stop in self.tokenizer.decode(request.ids[-(len(stop) + 1) :]):
                return "stop"
        if len(request.ids) >= request.max_new:
            return "length"
        return None

    def _finish(
        self, request: _Request, *, reason: str = "stop", error: Exception | None = None
    ) -> None:
        """Free the request's slot and queue its outcome for `_deliver`."""
        if request.slot >= 0:
            with self._wake:
                heapq.heappush(self._free, request.slot)
            request.slot = -1
        request.reason, request.error = reason, error
        self._ended.append(request)

    def _deliver(self) -> None:
        """Hand the requests that ended this step to their callers: one wake-up of each caller's
        event loop per step, not one per request (a loop thread woken a thousand times a second
        takes the interpreter lock from this thread as often)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Request]] = {}
        for request in self._ended:
            by_loop.setdefault(request.future.get_loop(), []).append(request)
        self._ended = []
        for loop, ended in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody waits
                loop.call_soon_threadsafe(_resolve, ended)


def _resolve(ended: list[_Request]) -> None:
    """On the callers' loop: complete the futures of ended requests, unless cancelled meanwhile."""
    for request in ended:
        if request.future.done():
            continue
        if request.error is not None:
            request.future.set_exception(request.error)
        else:
            request.future.set_result(
                Completion(request.ids, request.logprobs, request.versions, request.reason)
            )


def _slot(request: _Request) -> int:
    return request.slot


def _stop(wake: threading.Condition, closed: threading.Event, thread: threading.Thread) -> None:
    with wake:
        closed.set()
        wake.notify()
    thread.join()


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]
) -> tuple[list[int], list[float]]:
    """Draw one token per row of float32 logits [B, V], batched; return tokens and their logprobs.

    Each row is sampled by inverting its (temperature-scaled, top-p-truncated) CDF at its own
    uniform draw, so a request's tokens depend only on its seed, not on its batch-mates.
    Logprobs are after temperature and before top-p; temperature 0 is greedy on the raw logits.
    """
    temps = torch.tensor([p.temperature for p in params])
    greedy = temps == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps).unsqueeze(-1), dim=-1)
    probs = logp.exp()
    top_p = torch.tensor([p.top_p for p in params])
    if bool((top_p < 1.0).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest head of each row whose mass reaches its top_p (at least one token).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p.unsqueeze(-1)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    cdf = probs.cumsum(-1)
    u = torch.tensor(uniforms, dtype=cdf.dtype) * cdf[:, -1]
    drawn = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1)
    tokens = torch.where(greedy, logits.argmax(-1), drawn.clamp(max=logits.shape[-1] - 1))
    chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens.tolist(), chosen.tolist()
