"""A weight sync while an agent's calls are in flight: they wait, none is lost, and the recorded
versions say which weights served each token."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from rllm_async.protocols import Completion, SamplingParams
from rllm_async.rollout import SyncPause
from tests.gateway.test_gateway import KEY, open_session, openai, serving
from tests.scripted import ScriptedPolicy, context


def test_calls_during_a_pause_queue_and_are_served_by_the_new_weights() -> None:
    policy = ScriptedPolicy(lambda prompt: "ok")

    async def go() -> None:
        pause = SyncPause()  # the coordinator's, on for a weight sync
        pause.pause()
        ctx = context(policy, max_tokens=16, pause=pause)
        async with serving(policy) as gateway:
            session = gateway.session(ctx)
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=session.key)
            messages = [{"role": "user", "content": "q"}]
            calls = [
                asyncio.create_task(
                    client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
                )
                for _ in range(8)
            ]
            while session.calls < 8:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert not any(c.done() for c in calls) and policy.calls == []  # queued, none served
            policy.version = 1  # the sync finishes, then the pause lifts
            pause.resume()
            replies = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert [r.system_fingerprint for r in replies] == ["policy-v1"] * 8
        steps = ctx.trajectory().steps
        assert len(steps) == 8 and all(set(s.versions) == {1} for s in steps)

    asyncio.run(go())


def test_calls_outside_a_session_wait_for_the_sessions_pause() -> None:
    policy = ScriptedPolicy(lambda prompt: "ok")

    async def go() -> None:
        pause = SyncPause()
        pause.pause()
        ctx = context(policy, max_tokens=16, pause=pause)
        async with serving(policy) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
            messages: Any = [{"role": "user", "content": "q"}]
            r = await client.chat.completions.create(model="policy", messages=messages)
            assert r.system_fingerprint == "policy-v0"  # no session yet: nothing to wait on
            assert not await health_paused(gateway)
            gateway.session(ctx)  # the trainer's rollouts share the coordinator's pause
            assert await health_paused(gateway)  # clients can see the pause
            call = asyncio.create_task(
                client.chat.completions.create(model="policy", messages=messages)
            )
            text = asyncio.create_task(
                client.completions.create(model="policy", prompt="q", max_tokens=4)
            )
            await asyncio.sleep(0.3)
            assert not call.done() and not text.done() and len(policy.calls) == 1
            policy.version = 1
            pause.resume()
            r, t = await asyncio.wait_for(asyncio.gather(call, text), 30)
            assert not await health_paused(gateway)
            # Another trainer's pause, followed from now on.
            other = SyncPause()
            other.pause()
            gateway.follow_pause(other)
            assert await health_paused(gateway)
            other.resume()
            assert not await health_paused(gateway)
        assert r.system_fingerprint == "policy-v1" and t.choices[0].text == "ok"
        assert ctx.trajectory().steps == []  # served, not recorded in the session

    asyncio.run(go())


def test_sessions_opened_over_http_wait_for_the_pause_they_follow() -> None:
    policy = ScriptedPolicy(lambda prompt: "ok")

    async def go() -> None:
        pause = SyncPause()  # an online trainer's weight sync
        pause.pause()
        async with serving(policy) as gateway:
            opened = await open_session(gateway)
            client = openai.AsyncOpenAI(base_url=opened[1], api_key=KEY)
            messages: Any = [{"role": "user", "content": "q"}]
            await client.chat.completions.create(model="policy", messages=messages)
            gateway.follow_pause(pause)
            call = asyncio.create_task(
                client.chat.completions.create(model="policy", messages=messages)
            )
            await asyncio.sleep(0.3)
            assert not call.done() and len(policy.calls) == 1
            policy.version = 1
            pause.resume()
            r = await asyncio.wait_for(call, 30)
            steps = gateway.sessions.get(opened[0]).ctx.trajectory().steps
        assert r.system_fingerprint == "policy-v1"
        assert [set(s.versions) for s in steps] == [{0}, {1}]

    asyncio.run(go())


class _SlowFirst(ScriptedPolicy):
    """Takes `first_s` over its first generation, then answers at once."""

    def __init__(self, first_s: float) -> None:
        super().__init__(lambda prompt: "ok")
        self.first_s = first_s
        self.started = 0

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion:
        self.started += 1
        if self.started == 1:
            await asyncio.sleep(self.first_s)
        return await super().generate(prompt_ids, params, version=version)


def test_a_client_that_times_out_and_retries_gets_one_recorded_step_per_reply() -> None:
    """A call the client gave up on (waiting out a sync, or generating) is cancelled, so only the
    retry it got a reply for is recorded, with the weights that served it."""
    policy = _SlowFirst(first_s=2.0)

    async def go() -> None:
        pause = SyncPause()
        pause.pause()
        ctx = context(policy, max_tokens=16, pause=pause)
        sent: list[httpx.Request] = []

        async def count(request: httpx.Request) -> None:
            sent.append(request)

        async with serving(policy) as gateway:
            session = gateway.session(ctx)
            http = httpx.AsyncClient(event_hooks={"request": [count]})
            client = openai.AsyncOpenAI(
                base_url=f"{gateway.url}/v1",
                api_key=session.key,
                timeout=0.5,
                max_retries=8,
                http_client=http,
            )
            messages: Any = [{"role": "user", "content": "q"}]
            # The pause outlasts the client's timeout: the first attempts give up and retry.
            call = asyncio.create_task(
                client.chat.completions.create(model="policy", messages=messages)
            )
            async with asyncio.timeout(20):  # the client's backoff before a retry is 0.5-1 s
                while len(sent) < 2:
                    await asyncio.sleep(0.05)
            assert policy.started == 0
            policy.version = 1
            pause.resume()
            # The first attempt served generates for 2 s, past the timeout; a retry is answered.
            r = await asyncio.wait_for(call, 30)
            attempts = len(sent)
            # A call answered in time: one more step.
            r2 = await client.chat.completions.create(model="policy", messages=messages)
            await http.aclose()
        assert attempts >= 3 and policy.started >= 2
        assert r.system_fingerprint == r2.system_fingerprint == "policy-v1"
        steps = ctx.trajectory().steps
        assert len(steps) == 2 == len(policy.calls)
        assert [set(s.versions) for s in steps] == [{1}, {1}]
        assert [s.info["reply_id"] for s in steps] == [r.id, r2.id]

    asyncio.run(go())


async def health_paused(gateway: Any) -> bool:
    """What `/health` (no API key needed) says of a pause."""
    async with httpx.AsyncClient() as http:
        r = await http.get(f"{gateway.url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    paused = r.json()["paused"]
    assert isinstance(paused, bool)
    return paused
