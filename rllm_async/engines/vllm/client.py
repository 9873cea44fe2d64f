"""`VLLMPolicy`: the project's `PolicyClient` over one or more vLLM servers, token-in/token-out.

Requests go to `/inference/v1/generate` (servers started with `--enable-scale-out`) as token ids;
answers carry the sampled ids, the sampler's logprob of each (after temperature, as the local
sampler reports them) and spans saying which weight version sampled which tokens. Each request
goes to the server with the fewest requests in flight. Weight syncs reload a safetensors directory
into every server (`update_weights`).

Past 400 lines because requests, weight syncs and a dead server's recovery all read and change
the same per-server state (in flight, up, gone), which one class owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import httpx

from rllm_async.engines.vllm.errors import VLLMServerError
from rllm_async.engines.vllm.weights import check_weights
from rllm_async.grammar import embedded_schema
from rllm_async.protocols import Completion, SamplingParams, Tokenizer

PauseMode = Literal["keep", "wait", "abort"]
ABORTED = "abort"  # vLLM's finish_reason for a request a pause with mode=abort cut short
GENERATE = "/inference/v1/generate"
HEALTH_EVERY_S = 1.0  # how often a control call in flight checks that its server is alive


# Given the URL of a server that failed as if dead, make it serve again and return its URL (the
# same one when it is well), or raise `VLLMServerError` when it is gone for good.
Recover = Callable[[str], Awaitable[str]]


def _up() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass(slots=True)
class _Server:
    """One server, the requests this client has in flight on it, and its recovery, if any."""

    url: str
    in_flight: int = 0
    sent: int = 0
    up: asyncio.Event = field(default_factory=_up)  # cleared while the server is recovered
    recovery: asyncio.Task[None] | None = None
    gone: VLLMServerError | None = None  # why it cannot serve again
    lost: asyncio.Event = field(default_factory=asyncio.Event)  # set with `gone`


class _ServerDown(VLLMServerError):
    """The server could not be reached, broke the connection, or failed (HTTP 5xx)."""


@dataclass(frozen=True, slots=True)
class WeightSync:
    """What `update_weights` did: the version now served, the pause mode used, and how long the
    servers were paused (pause to resume, the slowest server's)."""

    version: int
    mode: PauseMode
    seconds: float


class VLLMPolicy:
    """Samples from vLLM servers that all hold the same weights, and syncs new weights into them.

    `acquire()` gives the version the servers hold; `release()` frees nothing (a server keeps one
    version). `generate(..., version=v)` refuses a `v` the servers no longer hold, and a
    completion that a sync moved to another version while it ran (`weight_update: pin` needs
    syncs with mode `wait` or `abort`). Connection failures, refusals (HTTP 4xx/5xx) and
    timeouts raise `VLLMServerError` naming the server. The servers are labelled with `version`
    on first use (`open()`), so every token's version is one of ours.

    With `recover`, a server that fails as if dead (no connection, a broken one, HTTP 5xx) is
    handed to it once at a time: the request that saw the failure still fails, and requests
    meanwhile go to the other servers or wait for it; a server `recover` gives up on fails every
    later request at once with its error.

    `SamplingParams.structured` goes to vLLM's structured outputs, which the servers must run on
    llguidance (`--structured-outputs-config.backend guidance`, as `VLLMServer` starts them) for
    a grammar to mean what it means on the local sampler: the grammar masks the logits before
    sampling, so the logprobs returned are those of the masked, renormalized distribution the
    tokens were drawn from (docs/constrained_decoding.md).
    """

    constrains_decoding = True

    def __init__(
        self,
        urls: Sequence[str],
        tokenizer: Tokenizer,
        *,
        max_context_tokens: int,
        version: int = 0,
        connect_timeout_s: float = 30.0,
        read_timeout_s: float = 600.0,
        sync_timeout_s: float = 60.0,
        max_connections: int = 1024,
        recover: Recover | None = None,
    ) -> None:
        if not urls:
            raise ValueError("VLLMPolicy needs at least one server URL")
        self._servers = [_Server(url.rstrip("/")) for url in urls]
        self._tokenizer = tokenizer
        self.max_context_tokens = max_context_tokens
        self._version = version
        # A long generation may take minutes to answer; connecting never should.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s, pool=None),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            trust_env=False,
        )
        self._sync_timeout = httpx.Timeout(sync_timeout_s, connect=connect_timeout_s)
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._sync_timeout_s = sync_timeout_s
        self._opened = False
        self._open_lock = asyncio.Lock()
        self._serving = asyncio.Event()  # cleared while a weight sync runs
        self._serving.set()
        self._seeded_in_flight = 0
        self._recover = recover

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def version(self) -> int:
        """The weight version every server holds."""
        return self._version

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per server URL."""
        return {s.url: s.in_flight for s in self._servers}

    def requests_sent(self) -> dict[str, int]:
        """Requests sent so far per server URL (each resumption of a cut request counts)."""
        return {s.url: s.sent for s in self._servers}

    def acquire(self) -> int:
        return self._version

    def release(self, version: int) -> None:
        """Nothing to free: the servers keep no older versions."""

    async def open(self) -> None:
        """Label every server's weights with this client's version; idempotent."""
        async with self._open_lock:
            if self._opened:
                return
            await asyncio.gather(*(self._label(s, self._version) for s in self._servers))
            self._opened = True

    async def close(self) -> None:
        """Close the HTTP connections (the servers keep running)."""
        await self._http.aclose()

    async def __aenter__(self) -> VLLMPolicy:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion:
        """Sample one completion on the least-loaded server.

        Stop strings end generation as in the local sampler: the ids keep every sampled token,
        the one that completes the stop string included (callers cut the decoded text). A request
        that a sync with mode `abort` cuts short is sent again, after the sync, with its prompt
        plus the tokens it already has. With `top_p < 1`, logprobs are renormalized over the
        top-p set (vLLM's `processed_logprobs`); the local sampler's are taken before top-p.
        """
        if not prompt_ids:
            raise ValueError("generate() needs at least one prompt token")
        limit = min(params.max_tokens, self.max_context_tokens - len(prompt_ids))
        if limit < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room in the servers' context of "
                f"{self.max_context_tokens} tokens: shorten the prompt or raise max_model_len"
            )
        await self.open()
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            await self._serving.wait()
            if version is not None and version != self._version:
                raise RuntimeError(_pin_error(version, self._version))
            choice = await self._send(
                [*prompt_ids, *ids],
                _sampling(params, limit - len(ids)),
                seeded=params.seed is not None,
            )
            ids += choice.ids
            logprobs += choice.logprobs
            versions += choice.versions
            if choice.finish_reason != ABORTED or len(ids) >= limit:
                break
            if params.structured is not None:
                # vLLM would start the grammar afresh after the tokens sent: start the reply over.
                ids, logprobs, versions = [], [], []
        if version is not None and any(v != version for v in versions):
            raise RuntimeError(_pin_error(version, max(versions)))
        finish = "stop" if choice.finish_reason == "stop" else "length"
        return Completion(ids, logprobs, versions, finish)

    async def settle(self) -> list[VLLMServerError]:
        """Wait for the recoveries under way; why each server that cannot serve again is gone."""
        await asyncio.gather(*(s.recovery for s in self._servers if s.recovery is not None))
        return [s.gone for s in self._servers if s.gone is not None]

    def _on_down(self, server: _Server) -> None:
        """Start recovering `server`, unless that is under way or was given up."""
        if self._recover is None or server.recovery is not None or server.gone is not None:
            return
        server.up.clear()
        server.recovery = asyncio.create_task(self._restore(server, self._recover))

    async def _restore(self, server: _Server, recover: Recover) -> None:
        try:
            server.url = (await recover(server.url)).rstrip("/")
        except VLLMServerError as e:
            server.gone = e
        except Exception as e:  # a failed restart: the server stays out, with the cause
            server.gone = VLLMServerError(f"the vLLM server at {server.url} failed: {e!r}")
        finally:
            server.recovery = None
            server.up.set()
            if server.gone is not None:
                server.lost.set()

    async def _send(self, token_ids: list[int], sampling: dict[str, Any], *, seeded: bool) -> Any:
        server = min(self._servers, key=lambda s: (not s.up.is_set(), s.in_flight, s.sent))
        await server.up.wait()  # all servers are being recovered: wait for this one
        if server.gone is not None:
            raise VLLMServerError(str(server.gone))
        server.in_flight += 1
        server.sent += 1
        self._seeded_in_flight += seeded
        try:
            body = await self._post(
                server,
                GENERATE,
                json={"token_ids": token_ids, "sampling_params": sampling},
                long=True,
            )
        finally:
            server.in_flight -= 1
            self._seeded_in_flight -= seeded
        return _parse_choice(server.url, body)

    async def update_weights(
        self, weights_dir: Path, version: int, *, mode: PauseMode = "keep"
    ) -> WeightSync:
        """Reload every server's weights from `weights_dir` (safetensors with Hugging Face names,
        see `write_weights`) and label them `version`, all servers at once.

        Each server is paused (`mode`: `keep` freezes requests in flight and continues them with
        the new weights; `wait` lets them finish first; `abort` cuts them, and `generate` sends
        them again), reloaded, its prefix cache dropped, relabelled and resumed, in a `finally`,
        even when the reload fails. New requests wait for the sync.
        vLLM's CPU engine dies when a request with a seed is frozen by `keep`, so a `keep` sync
        with seeded requests in flight runs as `wait` instead (the returned `mode` says which).
        `weights_dir` is checked first (readable safetensors headers): in vLLM 0.32 a reload that
        fails leaves the server's engine dead or hung, so it must then be restarted. Raises
        `VLLMServerError` naming each server that failed.
        """
        if mode == "keep" and self._seeded_in_flight:
            mode = "wait"
        weights_dir = Path(weights_dir).resolve()
        check_weights(weights_dir)  # vLLM's engine does not survive a failed reload
        await self.open()
        self._serving.clear()
        try:
            results = await asyncio.gather(
                *(self._sync_one(s, weights_dir, version, mode) for s in self._servers),
                return_exceptions=True,
            )
        finally:
            self._serving.set()
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise VLLMServerError(
                f"weight sync to version {version} failed on {len(failures)} of "
                f"{len(self._servers)} servers: " + "; ".join(str(f) for f in failures)
            ) from failures[0]
        self._version = version
        return WeightSync(version, mode, max(r for r in results if isinstance(r, float)))

    async def _sync_one(self, server: _Server, weights_dir: Path, version: int, mode: str) -> float:
        """Pause, reload, relabel and resume one server; the seconds it was paused."""
        start = time.perf_counter()
        await self._post(server, "/pause", params={"mode": mode}, long=True)
        failure: VLLMServerError | None = None
        try:
            await self._post(
                server,
                "/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}},
            )
            # No cached prefix of the old weights may serve a later request. Where blocks are
            # still held the reset refuses; then requests in flight are preempted as well, and
            # recompute their context with the new weights.
            reset = await self._post(server, "/reset_prefix_cache")
            if not _succeeded(reset):
                reset = await self._post(
                    server, "/reset_prefix_cache", params={"reset_running_requests": "true"}
                )
                if not _succeeded(reset):
                    raise VLLMServerError(
                        f"{server.url}/reset_prefix_cache refused to drop the prefixes cached "
                        f"under the old weights, also with running requests reset ({reset!r})"
                    )
            await self._label(server, version)
        except VLLMServerError as e:
            failure = e
        try:
            await self._post(server, "/resume")
        except VLLMServerError as e:
            if failure is None:
                raise
            raise VLLMServerError(
                f"{failure}; then {e}. A failed reload leaves vLLM's engine unusable: restart "
                f"the server ({server.url})"
            ) from failure
        if failure is not None:
            raise failure
        return time.perf_counter() - start

    async def _label(self, server: _Server, version: int) -> None:
        await self._post(server, "/update_weight_version", json={"new_version": str(version)})

    async def _post(self, server: _Server, path: str, *, long: bool = False, **kwargs: Any) -> Any:
        """POST to one server; its JSON answer, or `VLLMServerError` naming server and cause.

        Control calls are bounded by `sync_timeout_s`; `long` ones (generation, `/pause`, which
        may wait for requests in flight) by `read_timeout_s`. A connection that breaks is tried
        once more on a new one: the server closes idle keep-alive connections, and a request
        sent on one as it closes is lost (every call here may be sent twice: generation is
        stateless, the control calls idempotent); a server that died then refuses the retry.
        A control call that outlasts `HEALTH_EVERY_S` watches the server's `/health` meanwhile:
        vLLM never answers a control call that was in flight when its engine died (the API
        server stops listening and waits for it), so it fails once `/health` says so.
        """
        call = asyncio.ensure_future(self._post_once(server, path, long=long, **kwargs))
        watches: list[asyncio.Future[Any]] = []
        if self._recover is not None:
            # A server given up on may hang rather than refuse (vLLM's API server can stall
            # while it shuts down): its calls in flight then fail at once.
            watches.append(asyncio.ensure_future(server.lost.wait()))
        if path != GENERATE:
            watches.append(asyncio.ensure_future(self._sick(server)))
        try:
            await asyncio.wait((call, *watches), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for watch in watches:
                watch.cancel()
            if not call.done():
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, VLLMServerError):
                    await call
        try:
            if not call.cancelled():
                return call.result()
            if server.gone is not None:
                raise VLLMServerError(str(server.gone))
            sick = next(w.result() for w in watches if w.done() and not w.cancelled())
            raise _ServerDown(
                f"the vLLM server at {server.url} {sick} while {path} was in flight: "
                "did its engine die?"
            )
        except _ServerDown:
            self._on_down(server)
            raise

    async def _sick(self, server: _Server) -> str:
        """Return, saying what it answered, once `server`'s `/health` fails: HTTP 503 once
        vLLM's engine died, refused connections once its API server stopped listening. A
        probe that times out proves nothing (a busy server answers late) and is tried again."""
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            try:
                response = await self._http.get(f"{server.url}/health", timeout=self._sync_timeout)
            except httpx.ConnectError:
                return "refused connections to /health"
            except httpx.HTTPError:
                continue
            if response.status_code != 200:
                return f"answered /health with HTTP {response.status_code}"

    async def _post_once(self, server: _Server, path: str, *, long: bool, **kwargs: Any) -> Any:
        url = f"{server.url}{path}"
        timeout = httpx.USE_CLIENT_DEFAULT if long else self._sync_timeout
        try:
            try:
                response = await self._http.post(url, timeout=timeout, **kwargs)
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
                try:
                    response = await self._http.post(url, timeout=timeout, **kwargs)
                except httpx.ConnectError:
                    raise e from None
        except httpx.ConnectError as e:
            raise _ServerDown(
                f"cannot connect to the vLLM server at {server.url} ({e}): is it running?"
            ) from e
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
            raise _ServerDown(
                f"the connection to the vLLM server at {server.url} broke during {path} "
                f"({type(e).__name__}): did the server die?"
            ) from e
        except httpx.TimeoutException as e:
            if isinstance(e, httpx.ConnectTimeout):
                what = f"no connection within {self._connect_timeout_s:g}s"
            elif long:
                what = f"no answer to {path} within {self._read_timeout_s:g}s (read_timeout_s)"
            else:
                what = f"no answer to {path} within {self._sync_timeout_s:g}s (sync_timeout_s)"
            raise VLLMServerError(f"the vLLM server at {server.url} timed out: {what}") from e
        except httpx.HTTPError as e:
            raise VLLMServerError(f"{url} failed: {type(e).__name__}: {e}") from e
        if response.status_code >= 400:
            error = _ServerDown if response.status_code >= 500 else VLLMServerError
            raise error(f"{url} answered HTTP {response.status_code}: {response.text[:2000]}")
        return response.json() if response.content else None


@dataclass(slots=True)
class _Choice:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


def _sampling(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """vLLM sampling params; what the project's sampler does not do is switched off explicitly,
    so that a model's generation_config.json (top_k, penalties) cannot switch it on."""
    out: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": max_tokens,
        "logprobs": 0,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.seed is not None:
        out["seed"] = params.seed
    if params.structured is not None:
        out["structured_outputs"] = structured_outputs(params.structured)
    return out


def structured_outputs(structured: str) -> dict[str, Any]:
    """vLLM's `structured_outputs` for the constraint `structured`. A JSON schema carries our
    JSON whitespace options (`x-guidance`, which overrides the server's defaults), so that the
    `guidance` backend compiles the very grammar the local sampler does (`grammar.grammar_text`);
    regexes and Lark grammars go as they are."""
    spec = json.loads(structured)
    if isinstance(spec, dict) and len(spec) == 1:
        if isinstance(spec.get("json"), dict):
            return {"json": embedded_schema(spec["json"])}
        if spec.get("json_object") is True:
            return {"json": embedded_schema({"type": "object"})}
    return dict(spec)


def _parse_choice(url: str, body: Any) -> _Choice:
    """The one choice of a generate answer, with a version per token from its spans."""
    try:
        choice = body["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
        versions = [-1] * len(ids)
        for span in choice.get("weight_versions") or ():
            label = span["version"]
            if not str(label).lstrip("-").isdigit():
                raise VLLMServerError(
                    f"{url} labels its weights {label!r}, not a version number: it was not "
                    "labelled by this client (VLLMPolicy.open)"
                )
            versions[span["start"] : span["end"]] = [int(label)] * (span["end"] - span["start"])
        finish = str(choice.get("finish_reason"))
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise VLLMServerError(f"{url} sent an answer this client cannot read ({e!r})") from e
    if len(logprobs) != len(ids) or -1 in versions:
        raise VLLMServerError(
            f"{url} answered {len(ids)} tokens with {len(logprobs)} logprobs and versions for "
            f"{len(ids) - versions.count(-1)}: each token needs both"
        )
    return _Choice(ids, logprobs, versions, finish)


def _succeeded(answer: Any) -> bool:
    """Whether a `/reset_prefix_cache` answer says the cache was dropped."""
    return isinstance(answer, dict) and answer.get("success") is True


def _pin_error(wanted: int, served: int) -> str:
    return (
        f"version {wanted} was asked for, but the vLLM servers hold version {served}: a server "
        "keeps one version, so rollouts cannot stay pinned across a weight sync "
        "(set coordinator.weight_update: latest)"
    )
