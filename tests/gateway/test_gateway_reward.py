"""`POST /sessions/{id}/reward` on a standalone gateway: the reward closes the session and reaches
`on_reward` (and the export); every refusal names its problem and leaves the session as it was."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from rllm_async.gateway import Gateway
from rllm_async.gateway.sessions import Session
from rllm_async.protocols import SamplingParams
from rllm_async.rollout import RolloutContext
from tests.gateway.test_gateway import CHAT, KEY, serving
from tests.scripted import ScriptedPolicy

HEADERS = {"Authorization": f"Bearer {KEY}"}


async def chat(http: httpx.AsyncClient, sid: str) -> None:
    r = await http.post(f"/sessions/{sid}/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text


def test_a_reward_closes_the_session_and_reaches_on_reward_and_the_export(tmp_path: Path) -> None:
    rewarded: list[Session] = []
    export = tmp_path / "sessions.jsonl"

    async def go() -> None:
        policy = ScriptedPolicy(lambda prompt: "ok")
        async with (
            serving(policy, on_reward=rewarded.append, export_path=export) as gateway,
            httpx.AsyncClient(base_url=gateway.url, headers=HEADERS) as http,
        ):
            opened = (await http.post("/sessions", json={"task": "t1"})).json()
            assert opened["task"] == "t1"
            await chat(http, opened["id"])
            r = await http.post(f"/sessions/{opened['id']}/reward", json={"reward": 0.5})
            assert r.status_code == 200
            assert r.json() == {"id": opened["id"], "reward": 0.5, "task": "t1", "calls": 1}
            again = await http.post(f"/sessions/{opened['id']}/reward", json={"reward": 1})
            assert again.status_code == 409 and again.json()["error"]["code"] == "session_rewarded"
            call = await http.post(f"/sessions/{opened['id']}/v1/chat/completions", json=CHAT)
            assert call.status_code == 409 and "already has its reward" in call.text
            assert len(gateway.sessions) == 0

    asyncio.run(go())
    [session] = rewarded
    assert session.reward == 0.5 and session.task == "t1" and session.closed
    [line] = export.read_text().splitlines()
    record = json.loads(line)
    assert record["reward"] == 0.5 and record["task"] == "t1"
    assert len(record["trajectories"]["default"]) == 1


def test_refused_rewards_change_nothing() -> None:
    rewarded: list[Session] = []

    async def go() -> None:
        policy = ScriptedPolicy(lambda prompt: "ok")
        answer = asyncio.Event()  # set after the refusals: until then the busy call is in flight
        async with (
            serving(policy, on_reward=rewarded.append) as gateway,
            httpx.AsyncClient(base_url=gateway.url, headers=HEADERS, timeout=30) as http,
        ):
            empty = (await http.post("/sessions", json={})).json()["id"]
            keyed = (await http.post("/sessions", json={"task": "a"})).json()["id"]
            await chat(http, keyed)
            busy = (await http.post("/sessions", json={})).json()["id"]
            reply = policy.generate

            async def held(*args: Any, **kwargs: Any) -> Any:
                await answer.wait()
                return await reply(*args, **kwargs)

            policy.generate = held  # type: ignore[method-assign]
            in_flight = asyncio.create_task(chat(http, busy))
            while not gateway.sessions.get(busy).busy:
                await asyncio.sleep(0.01)
            refusals: list[tuple[str, Any, int, str, str]] = [
                (empty, {"reward": 1.0}, 409, "session_empty", "recorded no model call"),
                (busy, {"reward": 1.0}, 409, "session_busy", "a call in flight"),
                (keyed, {"reward": 1.0, "task": "b"}, 400, "invalid_parameter", "opened with"),
                (keyed, {"reward": "1"}, 400, "invalid_parameter", "reward"),
                (keyed, {"reward": None}, 400, "invalid_parameter", "reward"),
                (keyed, b'{"reward": Infinity}', 400, "invalid_parameter", "finite"),
                (keyed, {"score": 1.0}, 400, "invalid_parameter", "reward"),
            ]
            for sid, body, status, code, words in refusals:
                kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = await http.post(f"/sessions/{sid}/reward", **kwargs)
                error = r.json()["error"]
                assert (r.status_code, error["code"]) == (status, code), (body, error)
                assert words in error["message"], error
            answer.set()
            await in_flight
            assert len(gateway.sessions) == 3 and not rewarded
            assert gateway.sessions.get(keyed).reward is None
            r = await http.post(f"/sessions/{keyed}/reward", json={"reward": -2})
            assert r.status_code == 200 and r.json()["reward"] == -2.0

    asyncio.run(go())
    assert [s.reward for s in rewarded] == [-2.0]


def test_a_reward_past_the_sessions_ttl_is_late() -> None:
    expired: list[Session] = []

    async def go() -> None:
        policy = ScriptedPolicy(lambda prompt: "ok")
        async with (
            serving(policy, on_expired=expired.append, on_reward=lambda s: None) as gateway,
            httpx.AsyncClient(base_url=gateway.url, headers=HEADERS) as http,
        ):
            sid = (await http.post("/sessions", json={"ttl_s": 0.2})).json()["id"]
            await chat(http, sid)
            await asyncio.sleep(0.3)
            r = await http.post(f"/sessions/{sid}/reward", json={"reward": 1.0})
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_expired"
            assert "expired without a reward" in r.json()["error"]["message"]

    asyncio.run(go())
    assert len(expired) == 1 and expired[0].reward is None


def test_a_trainers_gateway_takes_no_rewards_over_http() -> None:
    async def go() -> None:
        policy = ScriptedPolicy(lambda prompt: "ok")
        gateway = Gateway(policy, api_key=KEY)
        await gateway.start()
        try:
            ctx = RolloutContext(
                policy,
                sampling=SamplingParams(max_tokens=8),
                pin=False,
                deadline=1e9,
                task_id="t",
            )
            session = gateway.session(ctx)
            async with httpx.AsyncClient(base_url=gateway.url, headers=HEADERS) as http:
                r = await http.post(f"/sessions/{session.id}/reward", json={"reward": 1.0})
            assert r.status_code == 403 and r.json()["error"]["code"] == "sessions_managed"
            assert session.reward is None and not session.closed
        finally:
            await gateway.stop()

    asyncio.run(go())


def test_a_reply_is_rewarded_by_its_id_once_and_the_session_stays_open(tmp_path: Path) -> None:
    export = tmp_path / "sessions.jsonl"

    async def go() -> None:
        policy = ScriptedPolicy(lambda prompt: "ok")
        async with (
            serving(policy, export_path=export) as gateway,
            httpx.AsyncClient(base_url=gateway.url, headers=HEADERS) as http,
        ):
            sid = (await http.post("/sessions", json={})).json()["id"]
            ids = []
            for path, body in (
                ("chat/completions", CHAT),
                ("responses", {"model": "policy", "input": "q"}),
                ("messages", {**CHAT, "max_tokens": 8}),
            ):
                r = await http.post(f"/sessions/{sid}/v1/{path}", json=body)
                assert r.status_code == 200, r.text
                ids.append(r.json()["id"])
            url = f"/sessions/{sid}/reward"
            for reply_id, value in zip(ids, (0.25, -0.5, 1.0), strict=True):
                r = await http.post(url, json={"reward": value, "response_id": reply_id})
                assert r.status_code == 200 and r.json()["response_id"] == reply_id
                assert r.json()["reward"] == value
            refusals = [
                ({"reward": 2.0, "response_id": ids[0]}, 409, "response_rewarded"),
                ({"reward": 2.0, "response_id": "chatcmpl-nope"}, 404, "response_not_found"),
                ({"reward": 2.0, "response_id": ""}, 400, "invalid_parameter"),
            ]
            for body, status, code in refusals:
                r = await http.post(url, json=body)
                assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
            assert len(gateway.sessions) == 1  # still open: the episode's reward is to come
            assert (await http.post(url, json={"reward": 3.0})).status_code == 200

    asyncio.run(go())
    [line] = export.read_text().splitlines()
    record = json.loads(line)
    steps = record["trajectories"]["default"]
    assert record["reward"] == 3.0 and [s["reward"] for s in steps] == [0.25, -0.5, 1.0]
    prefixes = [s["info"]["reply_id"].split("-")[0].split("_")[0] for s in steps]
    assert prefixes == ["chatcmpl", "resp", "msg"]
