"""OnlineWorkflow's parts: episodes grouped by key and expired when their group does not fill,
rollouts of one dispatch sharing one group, a dispatch that gave up leaving its group queued, and
the group key of sessions without one."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from rllm_async.protocols import SamplingParams
from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode
from rllm_async.workflows.online import EpisodeGroups, OnlineWorkflow
from tests.scripted import ScriptedPolicy


def episode(name: str) -> Episode:
    return Episode(task_id=name)


def test_groups_fill_by_key_in_completion_order_and_incomplete_ones_expire() -> None:
    async def go() -> None:
        groups = EpisodeGroups(group_size=2, ttl_s=10.0)
        groups.add("a", episode("a1"), now=0.0)
        groups.add("b", episode("b1"), now=1.0)
        groups.add("c", episode("c1"), now=2.0)
        groups.add("b", episode("b2"), now=3.0)
        groups.add("a", episode("a2"), now=4.0)
        assert [e.task_id for e in await groups.next()] == ["b1", "b2"]
        assert [e.task_id for e in await groups.next()] == ["a1", "a2"]
        assert groups.pending == 1
        assert groups.expire(now=11.9) == 0  # c's first episode came at 2.0
        assert groups.expire(now=12.0) == 1 and groups.pending == 0
        groups.add("c", episode("c2"), now=13.0)  # starts a new group of c
        assert groups.pending == 1
        waiting = asyncio.create_task(groups.next())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        groups.add("c", episode("c3"), now=14.0)
        assert [e.task_id for e in await asyncio.wait_for(waiting, 1)] == ["c2", "c3"]

    asyncio.run(go())


def context(index: int) -> RolloutContext:
    return RolloutContext(
        ScriptedPolicy(lambda prompt: "ok"),
        sampling=SamplingParams(),
        pin=False,
        deadline=1e9,
        task_id="slot",
        rollout_index=index,
    )


def workflow(**options: Any) -> OnlineWorkflow:
    return OnlineWorkflow(group_size=2, sampling=SamplingParams(max_tokens=8), **options)


def test_the_rollouts_of_a_dispatch_share_a_group_and_a_dispatch_that_gave_up_loses_none() -> None:
    async def go() -> None:
        wf = workflow()
        await wf.start(ScriptedPolicy(lambda prompt: "ok"))
        try:
            # A dispatch whose rollouts give up (their deadline) before any group is ready.
            gave_up = [asyncio.create_task(wf.run({"id": "s0"}, context(i))) for i in range(2)]
            await asyncio.sleep(0.01)
            for task in gave_up:
                task.cancel()
            await asyncio.gather(*gave_up, return_exceptions=True)
            one = [asyncio.create_task(wf.run({"id": "s1"}, context(i))) for i in range(2)]
            two = [asyncio.create_task(wf.run({"id": "s2"}, context(i))) for i in range(2)]
            await asyncio.sleep(0.01)
            for key in ("x", "y"):
                for i in range(2):
                    wf.groups.add(key, episode(f"{key}{i}"), now=0.0)
            first = [e.task_id for e in await asyncio.gather(*one)]
            second = [e.task_id for e in await asyncio.gather(*two)]
            assert sorted([first, second]) == [["x0", "x1"], ["y0", "y1"]]
            # The same slot dispatched again gets the next group, not the one it had.
            wf.groups.add("z", episode("z0"), now=0.0)
            wf.groups.add("z", episode("z1"), now=0.0)
            again = await asyncio.gather(*(wf.run({"id": "s1"}, context(i)) for i in range(2)))
            assert [e.task_id for e in again] == ["z0", "z1"]
        finally:
            await wf.close()

    asyncio.run(go())


def test_sessions_without_a_task_key_are_grouped_by_their_first_prompt() -> None:
    async def go() -> None:
        wf = workflow(api_key="k")
        await wf.start(ScriptedPolicy(lambda prompt: "ok"))
        assert wf.gateway is not None
        try:
            async with httpx.AsyncClient(
                base_url=wf.gateway.url, headers={"Authorization": "Bearer k"}
            ) as http:
                for prompt in ("p", "q", "p", "q"):
                    sid = (await http.post("/sessions", json={})).json()["id"]
                    body = {"model": "policy", "messages": [{"role": "user", "content": prompt}]}
                    r = await http.post(f"/sessions/{sid}/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    reward = await http.post(f"/sessions/{sid}/reward", json={"reward": 1})
                    assert reward.status_code == 200, reward.text
            prompts = []
            for n in range(2):
                group = await asyncio.gather(
                    *(wf.run({"id": f"s{n}"}, context(i)) for i in range(2))
                )
                assert all(e.reward == 1.0 and e.metrics["calls"] == 1 for e in group)
                firsts = {tuple(e.trajectories[0].steps[0].prompt_ids) for e in group}
                assert len(firsts) == 1  # one prompt per group
                prompts += firsts
            assert prompts[0] != prompts[1]
            assert wf.groups.pending == 0
        finally:
            await wf.close()

    asyncio.run(go())


def test_a_replys_reward_adds_to_the_episodes() -> None:
    async def go() -> None:
        wf = OnlineWorkflow(group_size=1, sampling=SamplingParams(max_tokens=8), api_key="k")
        await wf.start(ScriptedPolicy(lambda prompt: "ok"))
        assert wf.gateway is not None
        try:
            async with httpx.AsyncClient(
                base_url=wf.gateway.url, headers={"Authorization": "Bearer k"}
            ) as http:
                sid = (await http.post("/sessions", json={"task": "t"})).json()["id"]
                body = {"model": "policy", "messages": [{"role": "user", "content": "q"}]}
                reply = await http.post(f"/sessions/{sid}/v1/chat/completions", json=body)
                first = {"reward": 0.25, "response_id": reply.json()["id"]}
                assert (await http.post(f"/sessions/{sid}/reward", json=first)).status_code == 200
                assert wf.groups.pending == 0  # the session is still open: no episode yet
                await http.post(f"/sessions/{sid}/v1/chat/completions", json=body)
                assert (
                    await http.post(f"/sessions/{sid}/reward", json={"reward": 1.0})
                ).status_code == 200
            episode = await wf.run({"id": "s0"}, context(0))
            [traj] = episode.trajectories
            assert [s.reward for s in traj.steps] == [0.25, None]
            assert traj.reward == episode.reward == 1.25
        finally:
            await wf.close()

    asyncio.run(go())
