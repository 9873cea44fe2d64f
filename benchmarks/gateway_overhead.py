"""What the gateway costs: added latency per call, sustained requests/s, memory over many sessions.

The policy answers instantly (a fixed 8-token reply on the character tokenizer), so every figure is
the gateway's own cost (HTTP, JSON, validation, chat rendering, recording) plus the client's.
Prints one JSON line:
- direct_p50_ms / direct_p99_ms: `ctx.chat_turn` on the policy, no HTTP;
- httpx_p50_ms / httpx_p99_ms and openai_p50_ms / openai_p99_ms: the same call through a session of
  an in-process gateway on 127.0.0.1, with raw httpx and with the official `openai` client;
- added_p50_ms / added_p99_ms: openai minus direct (what an agent sees);
- rps_256_sessions: chat calls per second sustained by a gateway in its own process with 256
  concurrent sessions, each a client loop in this process on its own keep-alive connection;
  server_cpu_ms_per_call: the gateway process's CPU time per call meanwhile (a figure that does
  not depend on what else shares the machine);
- shared_client_* / client_per_rollout_*: rollouts of 4 chat calls each, 256 at a time, on the
  gateway in its own process, every rollout in its own session, with the official `openai` client:
  one shared client (the session named by its API key, `with_options`) against a new client per
  rollout (the session in its base URL; built and closed by the rollout). `_call_p50_ms` /
  `_call_p99_ms`: one call as the agent sees it, client construction included in the first call
  of a rollout; `_calls_per_s`: calls completed per second; `client_construct_ms`: building one
  `AsyncOpenAI` without an HTTP client to share;
- alloc_blocks_per_1000_sessions: live Python memory blocks of a process running the gateway after
  each 1,000 of 10,000 sessions, each opened, called once and closed (flat: nothing accumulates);
  rss_mb_first_last: its resident memory before and after; open_sessions_after: sessions left open; alloc_blocks_2048_left_open and
  blocks_per_open_session: the control, 2,048 more sessions called once and left open.

Usage: python benchmarks/gateway_overhead.py [--calls 1000] [--seconds 10] [--sessions 10000]
       [--rollouts 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.gateway import Gateway
from rllm_async.protocols import Completion, SamplingParams, Tokenizer
from rllm_async.rollout import RolloutContext

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "guess 1-15"}]}


class InstantPolicy:
    """Replies "answer42" at once; version 0."""

    def __init__(self) -> None:
        self.tok = CharTokenizer()
        self.reply = [*self.tok.encode("answer42"), self.tok.eos_token_id]

    @property
    def tokenizer(self) -> Tokenizer:
        return self.tok

    def acquire(self) -> int:
        return 0

    def release(self, version: int) -> None:
        return None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion:
        n = len(self.reply)
        return Completion(list(self.reply), [-0.1] * n, [0] * n)


def _context(policy: InstantPolicy) -> RolloutContext:
    return RolloutContext(policy, sampling=SamplingParams(), pin=True, deadline=1e18, task_id="b")


async def _times(fn: Callable[[], Awaitable[object]], n: int) -> list[float]:
    for _ in range(min(50, n)):  # warm up connections and caches
        await fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _pct(xs: list[float], q: float) -> float:
    return round(statistics.quantiles(xs, n=100)[int(q) - 1], 3)


async def latency(calls: int) -> dict[str, float]:
    """p50/p99 per call: direct, raw HTTP and the openai client, one call at a time."""
    policy = InstantPolicy()
    direct_ctx = _context(policy)
    messages = CHAT["messages"]
    direct = await _times(lambda: direct_ctx.chat_turn(messages), calls)  # type: ignore[arg-type]
    gateway = Gateway(policy, max_calls_per_session=10**6)
    await gateway.start()
    try:
        session = gateway.session(_context(policy))
        url = gateway.session_url(session.id)
        async with httpx.AsyncClient() as http:
            raw = await _times(lambda: http.post(f"{url}/chat/completions", json=CHAT), calls)
        async with AsyncOpenAI(base_url=url, api_key="-") as client:
            sdk = await _times(
                lambda: client.chat.completions.create(model="policy", messages=messages),  # type: ignore[arg-type]
                calls,
            )
        gateway.sessions.close(session.id)
    finally:
        await gateway.stop()
    out = {}
    for name, xs in (("direct", direct), ("httpx", raw), ("openai", sdk)):
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = _pct(xs, 50), _pct(xs, 99)
    out["added_p50_ms"] = round(out["openai_p50_ms"] - out["direct_p50_ms"], 3)
    out["added_p99_ms"] = round(out["openai_p99_ms"] - out["direct_p99_ms"], 3)
    return out


async def serve_forever() -> None:
    """The child process: a standalone gateway on the instant policy; prints its URL."""
    gateway = Gateway(InstantPolicy(), open_sessions=True, max_calls_per_session=10**6)
    await gateway.start()
    print(gateway.url, flush=True)
    await asyncio.Event().wait()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Connection:
    """A minimal keep-alive HTTP/1.1 client: the load generator must cost less than the server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> _Connection:
        host, port = url.split("//")[1].split("/")[0].split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def post(self, path: str, body: bytes) -> int:
        head = f"POST {path} HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
        self.writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        length = next(int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length"))
        await self.reader.readexactly(length)
        return int(lines[0].split()[1])

    def close(self) -> None:
        self.writer.close()


async def throughput(
    url: str, pid: int, seconds: float, concurrency: int = 256
) -> dict[str, float]:
    """Chat calls per second over `seconds`, `concurrency` sessions calling in a loop, and the
    server's CPU time per call (which does not depend on what else the machine runs)."""
    async with httpx.AsyncClient(timeout=60) as http:
        sessions = [
            (await http.post(f"{url}/sessions", json={})).json() for _ in range(concurrency)
        ]
    conns = [await _Connection.open(url) for _ in sessions]
    paths = [s["base_url"].split("/", 3)[3] for s in sessions]
    body = json.dumps(CHAT).encode()
    done = 0
    stop_at = 0.0

    async def loop(conn: _Connection, path: str) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            if await conn.post(f"/{path}/chat/completions", body) != 200:
                raise RuntimeError("a chat call failed")
            done += 1

    stop_at = time.perf_counter() + 2.0  # warm-up
    await asyncio.gather(*(loop(c, p) for c, p in zip(conns, paths, strict=True)))
    done, cpu0, t0 = 0, _cpu_s(pid), time.perf_counter()
    stop_at = t0 + seconds
    await asyncio.gather(*(loop(c, p) for c, p in zip(conns, paths, strict=True)))
    elapsed, cpu = time.perf_counter() - t0, _cpu_s(pid) - cpu0
    for conn in conns:
        conn.close()
    async with httpx.AsyncClient(timeout=60) as http:
        for s in sessions:
            await http.delete(f"{url}/sessions/{s['id']}")
    return {
        "rps_256_sessions": round(done / elapsed, 1),
        "server_cpu_ms_per_call": round(1e3 * cpu / max(done, 1), 3),
    }


async def memory(sessions: int, concurrency: int = 32) -> dict[str, object]:
    """Live Python memory blocks (`sys.getallocatedblocks`, after a GC) of a process running an
    in-process gateway, after each 1,000 sessions opened, called once and closed; then the same
    with 2,048 sessions left open, as a control that the measure sees a leak."""
    gateway = Gateway(InstantPolicy(), open_sessions=True)
    await gateway.start()

    def blocks() -> int:
        gc.collect()
        return sys.getallocatedblocks()

    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:

            async def one(close: bool) -> None:
                s = (await http.post("/sessions", json={})).json()
                (await http.post(f"{s['base_url']}/chat/completions", json=CHAT)).raise_for_status()
                if close:
                    (await http.delete(f"/sessions/{s['id']}")).raise_for_status()

            async def run(n: int, close: bool) -> None:
                for start in range(0, n, concurrency):
                    await asyncio.gather(*(one(close) for _ in range(min(concurrency, n - start))))

            await run(1000, close=True)  # warm-up: connections, caches, lazy imports
            series, rss = [blocks()], [_rss_mb(os.getpid())]
            for _ in range(0, sessions, 1000):
                await run(1000, close=True)
                series.append(blocks())
            rss.append(_rss_mb(os.getpid()))
            left = len(gateway.sessions)
            await run(2048, close=False)
            leaked = blocks()
    finally:
        await gateway.stop()
    return {
        "alloc_blocks_per_1000_sessions": series,
        "rss_mb_first_last": rss,
        "open_sessions_after": left,
        "alloc_blocks_2048_left_open": leaked,
        "blocks_per_open_session": round((leaked - series[-1]) / 2048, 1),
    }


async def _rollouts(
    url: str, http: httpx.AsyncClient, shared: AsyncOpenAI | None, n: int, concurrency: int
) -> tuple[list[float], float]:
    """`n` rollouts of 4 chat calls, `concurrency` at a time, each in a session of its own: on
    `shared` (the session named by its API key), else on a client of their own; the call times
    (ms) and the seconds they took."""
    gate = asyncio.Semaphore(concurrency)
    times: list[float] = []

    async def rollout() -> None:
        async with gate:
            session = (await http.post(f"{url}/sessions", json={})).json()
            t0 = time.perf_counter()
            if shared is not None:
                client = shared.with_options(api_key=session["api_key"])
            else:
                client = AsyncOpenAI(base_url=session["base_url"], api_key="-", max_retries=0)
            for _ in range(4):
                await client.chat.completions.create(**CHAT)  # type: ignore[call-overload]
                times.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
            if shared is None:
                await client.close()
            await http.delete(f"{url}/sessions/{session['id']}")

    start = time.perf_counter()
    await asyncio.gather(*(rollout() for _ in range(n)))
    return times, time.perf_counter() - start


async def clients(url: str, rollouts: int, concurrency: int = 256) -> dict[str, float]:
    """Rollouts of 4 calls, `concurrency` at a time: one shared `openai` client vs one each."""
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for mode in ("shared_client", "client_per_rollout"):
            shared = None
            if mode == "shared_client":
                shared = AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
            await _rollouts(url, http, shared, concurrency, concurrency)  # warm-up
            times, elapsed = await _rollouts(url, http, shared, rollouts, concurrency)
            if shared is not None:
                await shared.close()
            out[f"{mode}_call_p50_ms"] = _pct(times, 50)
            out[f"{mode}_call_p99_ms"] = _pct(times, 99)
            out[f"{mode}_calls_per_s"] = round(len(times) / elapsed, 1)
    t0 = time.perf_counter()
    for _ in range(20):
        await AsyncOpenAI(base_url=f"{url}/v1", api_key="-").close()
    out["client_construct_ms"] = round((time.perf_counter() - t0) * 1e3 / 20, 2)
    return out


async def main(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = dict(await latency(args.calls))
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        url = child.stdout.readline().strip()
        out.update(await throughput(url, child.pid, args.seconds))
        out.update(await clients(url, args.rollouts))
    finally:
        child.terminate()
        child.wait(10)
    out.update(await memory(args.sessions))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--rollouts", type=int, default=2048)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve_forever())
    else:
        print(json.dumps(asyncio.run(main(args))))
