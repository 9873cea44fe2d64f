"""Online RL end to end: clients with the real `openai` package run episodes in sessions of the
gateway that `serve --train` starts, report rewards over HTTP afterwards, and the trainer (the
local backend's tiny model) trains on exactly those episodes, under the staleness bound; sessions
never rewarded expire and are counted; malformed and late rewards are refused and change nothing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai

from rllm_async.config import config_from_dict
from rllm_async.serve import online_trainer

KEY = "online-test-key"
ROOT = Path(__file__).parents[2]  # this checkout, whatever is installed


class Client:
    """An agent's side of the protocol: open a session, call the model, report the reward."""

    def __init__(self, url: str) -> None:
        self.http = httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        )

    async def episode(self, task: str, ttl_s: float | None = None) -> dict[str, Any]:
        """An episode of two chat calls in a new session; the session's records."""
        body: dict[str, Any] = {"task": task} | ({"ttl_s": ttl_s} if ttl_s else {})
        opened = (await self.http.post("/sessions", json=body)).json()
        model = openai.AsyncOpenAI(base_url=opened["base_url"], api_key=opened["api_key"])
        messages: list[Any] = [{"role": "user", "content": f"{task} 2 3"}]
        for _ in range(2):
            reply = await model.chat.completions.create(
                model="policy", messages=messages, max_tokens=6
            )
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": "again"},
            ]
        await model.close()
        return (await self.http.get(f"/sessions/{opened['id']}")).json()

    async def reward(self, sid: str, body: Any) -> httpx.Response:
        if isinstance(body, bytes):
            return await self.http.post(f"/sessions/{sid}/reward", content=body)
        return await self.http.post(f"/sessions/{sid}/reward", json=body)


def completion_tokens(records: dict[str, Any]) -> int:
    return sum(
        len(s["completion_ids"]) for steps in records["trajectories"].values() for s in steps
    )


async def until(predicate: Any, what: str, timeout_s: float = 120.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)
    assert predicate(), what


def test_rewarded_episodes_are_trained_expired_and_refused_ones_are_not(tmp_path: Path) -> None:
    config = config_from_dict(
        {
            "name": "online",
            "run_dir": str(tmp_path),
            "backend": {"name": "local", "model": "tiny", "max_seq_len": 256},
            "rollout": {"group_size": 2, "max_tokens": 6, "timeout_s": 600},
            "coordinator": {"pipeline_depth": 0, "max_staleness": 0, "stale_policy": "drop"},
            "train": {"total_steps": 2, "groups_per_step": 1},
            "algorithm": {"filter_zero_variance": False},
            "checkpoint": {"resume": "never", "at_end": False},
            "logging": {"progress_bar": False},
        }
    )
    trainer = online_trainer(config, host="127.0.0.1", port=0, api_key=KEY, model="policy")
    workflow = trainer.workflow

    async def go() -> None:
        fit = asyncio.create_task(trainer.fit())
        await until(lambda: getattr(workflow, "gateway", None) is not None, "the gateway started")
        client = Client(workflow.gateway.url)  # type: ignore[attr-defined]
        # Version 0: four episodes in two groups, and one that will never be rewarded.
        add = [await client.episode("add") for _ in range(2)]
        sub = [await client.episode("sub") for _ in range(2)]
        forgotten = await client.episode("add", ttl_s=2.0)
        for sid, value in ((add[0]["id"], 0.25), (add[1]["id"], 1.0)):
            assert (await client.reward(sid, {"reward": value})).status_code == 200
        await until(lambda: len(trainer.records) == 1, "the first step")
        first = trainer.records[0]
        assert first["policy_version"] == 1 and first["train/groups"] == 1
        assert first["groups/consumed"] == 1 and first["groups/dropped_stale"] == 0
        assert first["reward/mean"] == 0.625  # exactly the two rewarded episodes
        assert first["tokens/generated"] == sum(completion_tokens(r) for r in add)
        assert first["staleness/max"] == 0

        async def expired() -> bool:  # the unrewarded session's TTL passes, the sweeper closes it
            answer = await client.http.get(f"/sessions/{forgotten['id']}")
            return answer.status_code == 404 and answer.json()["error"]["code"] == "session_expired"

        async with asyncio.timeout(60):
            while not await expired():
                await asyncio.sleep(0.1)
        pending = workflow.groups.pending  # type: ignore[attr-defined]
        refusals = [
            (add[0]["id"], {"reward": 2.0}, 409, "session_rewarded"),  # already rewarded
            (forgotten["id"], {"reward": 1.0}, 404, "session_expired"),  # late
            ("nope", {"reward": 1.0}, 404, "session_not_found"),
            (sub[0]["id"], {"reward": "high"}, 400, "invalid_parameter"),
            (sub[0]["id"], b'{"reward": NaN}', 400, "invalid_parameter"),
            (sub[0]["id"], {"reward": True}, 400, "invalid_parameter"),
            (sub[0]["id"], {}, 400, "invalid_parameter"),
            (sub[0]["id"], {"reward": 1.0, "bonus": 1}, 400, "invalid_parameter"),
            (sub[0]["id"], {"reward": 1.0, "task": "mul"}, 400, "invalid_parameter"),
            (sub[0]["id"], b"[1.0]", 400, "invalid_json"),
        ]
        for sid, body, status, code in refusals:
            answer = await client.reward(sid, body)
            error = answer.json()["error"]
            assert (answer.status_code, error["code"]) == (status, code), (body, error)
            assert error["message"] and error["type"]
        await asyncio.sleep(0.3)
        assert len(trainer.records) == 1 and trainer.coordinator.version == 1
        assert workflow.groups.pending == pending == 0  # type: ignore[attr-defined]

        # The version-0 group rewarded now is one step too stale: dropped, counted, not trained.
        for sid in (sub[0]["id"], sub[1]["id"]):
            assert (await client.reward(sid, {"reward": 0.9})).status_code == 200
        # A fresh group sampled with version 1 weights is trained.
        mul = [await client.episode("mul") for _ in range(2)]
        for sid, value in ((mul[0]["id"], 0.0), (mul[1]["id"], 1.0)):
            assert (await client.reward(sid, {"reward": value})).status_code == 200
        await asyncio.wait_for(fit, 120)

    asyncio.run(go())
    records = trainer.records
    assert [r["policy_version"] for r in records] == [1, 2]
    second = records[1]
    assert second["groups/dropped_stale"] == 1 and second["groups/consumed"] == 1
    assert second["reward/mean"] == 0.5 and second["staleness/max"] == 0
    assert sum(r.get("workflow/sessions_expired", 0) for r in records) == 1
    assert all(r["staleness/max"] <= 0 for r in records)


def test_the_command_and_the_example_client_train_until_the_last_step(tmp_path: Path) -> None:
    serve = [
        sys.executable,
        "-m",
        "rllm_async.cli",
        "serve",
        "--train",
        str(ROOT / "examples/online/local.yaml"),
        f"run_dir={tmp_path}",
        "train.total_steps=3",
        "logging.progress_bar=false",
        "--port",
        "0",
    ]
    env = {**os.environ, "RLLM_ASYNC_API_KEY": KEY, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(serve, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert server.stdout is not None
        announced = json.loads(server.stdout.readline())
        assert announced["model"] == "policy" and announced["version"] == 0
        client = [sys.executable, str(ROOT / "examples/online/client.py")]
        client += ["--url", announced["url"], "--api-key", KEY]
        done = subprocess.run(client, capture_output=True, text=True, timeout=240, env=env)
        assert server.wait(timeout=60) == 0
    finally:
        server.kill()
    assert done.returncode == 0, done.stderr
    assert "round 1: mean reward" in done.stdout and "stopped after" in done.stdout
    lines = (tmp_path / "online-local" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    assert all(r["train/groups"] == 2 and r["staleness/max"] <= 2 for r in records)
