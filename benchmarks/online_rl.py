"""Online RL on the CPU: the trainer of `rllm-async serve --train` (examples/online/local.yaml, the
local backend's tiny model) fed by client loops in this process that use the official `openai`
client, each running episodes (a session per episode, one chat call, the toy reward of
examples/online/client.py) and reporting rewards over HTTP until the trainer stops.

Prints one JSON line:
- steps, wall_s: optimizer steps taken and the wall time from the gateway's start to the last;
- episodes_rewarded, episodes_trained, episodes_per_s: rewards accepted, episodes in the groups
  trained (groups/consumed x group_size), and rewarded episodes per second;
- call_p50_ms, reward_p50_ms / reward_p99_ms: one chat call and one reward POST as the client sees
  them (both wait out the weight syncs that fall in them);
- staleness_max, dropped_stale: the largest staleness trained and the groups dropped as too stale;
- reward_first5 / reward_last5: the trained groups' mean reward over the first and last 5 steps.

Usage: python benchmarks/online_rl.py [--steps 20] [--clients 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from openai import APIError, AsyncOpenAI

from rllm_async.config import load_config
from rllm_async.serve import online_trainer

ROOT = Path(__file__).resolve().parents[1]
TASKS = {"greet": "Say hello.", "count": "Count to three.", "name": "Name a colour."}
KEY = "bench"


async def client_loop(url: str, index: int, out: dict[str, list[float]]) -> None:
    """Episodes until the trainer stops serving; the latencies of its calls and rewards."""
    headers = {"Authorization": f"Bearer {KEY}"}
    tasks = list(TASKS)
    async with (
        httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http,
        AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY) as model,
    ):
        n = index
        while True:
            task = tasks[n % len(tasks)]
            n += 1
            try:
                opened = (await http.post("/sessions", json={"task": task})).json()
                t0 = time.perf_counter()
                reply = await model.with_options(api_key=opened["api_key"]).chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": TASKS[task]}]
                )
                t1 = time.perf_counter()
                text = reply.choices[0].message.content or ""
                body = {"reward": -abs(len(text) - 12) / 12}
                answer = await http.post(f"/sessions/{opened['id']}/reward", json=body)
                t2 = time.perf_counter()
            except (httpx.HTTPError, APIError, KeyError):
                return  # the trainer stopped serving
            if answer.status_code != 200:
                return
            out["call_s"].append(t1 - t0)
            out["reward_s"].append(t2 - t1)


async def run(steps: int, clients: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(
            ROOT / "examples/online/local.yaml",
            [
                f"run_dir={run_dir}",
                f"train.total_steps={steps}",
                "logging.progress_bar=false",
                "checkpoint.every_steps=0",
                "checkpoint.at_end=false",
            ],
        )
        trainer = online_trainer(config, host="127.0.0.1", port=0, api_key=KEY, model="policy")
        workflow: Any = trainer.workflow
        fit = asyncio.create_task(trainer.fit())
        while workflow.gateway is None or not workflow.gateway.url:
            await asyncio.sleep(0.01)
        start = time.perf_counter()
        out: dict[str, list[float]] = {"call_s": [], "reward_s": []}
        loops = [
            asyncio.create_task(client_loop(workflow.gateway.url, i, out)) for i in range(clients)
        ]
        records = await fit
        wall = time.perf_counter() - start
        await asyncio.gather(*loops)
    group_size = config.rollout.group_size
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    reward_s = sorted(out["reward_s"])
    return {
        "steps": len(records),
        "wall_s": round(wall, 2),
        "clients": clients,
        "episodes_rewarded": len(reward_s),
        "episodes_trained": int(sum(r["groups/consumed"] for r in records)) * group_size,
        "episodes_per_s": round(len(reward_s) / wall, 1),
        "call_p50_ms": round(1000 * statistics.median(out["call_s"]), 1),
        "reward_p50_ms": round(1000 * statistics.median(reward_s), 1),
        "reward_p99_ms": round(1000 * reward_s[int(0.99 * (len(reward_s) - 1))], 1),
        "staleness_max": max(r["staleness/max"] for r in records),
        "dropped_stale": int(sum(r["groups/dropped_stale"] for r in records)),
        "reward_first5": round(statistics.mean(rewards[:5]), 3),
        "reward_last5": round(statistics.mean(rewards[-5:]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    with contextlib.redirect_stdout(io.StringIO()):  # the gateway's URL line
        result = asyncio.run(run(args.steps, args.clients))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
