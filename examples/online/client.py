"""Episodes for `rllm-async serve --train`: each opens a session with its task key, asks the
policy with the `openai` client, scores the reply itself and reports the reward afterwards.

    python examples/online/client.py --url http://127.0.0.1:8000 --api-key secret

The toy reward (a reply of about 12 characters scores best) stands for whatever a deployed
agent's harness measures. Runs until the trainer stops serving (after train.total_steps).
"""

from __future__ import annotations

import argparse
import asyncio

import httpx
from openai import APIError, AsyncOpenAI

TASKS = {"greet": "Say hello.", "count": "Count to three.", "name": "Name a colour."}


async def episode(http: httpx.AsyncClient, model: AsyncOpenAI, task: str) -> float:
    """One episode in a session of its own; the reward is reported once it has ended."""
    opened = (await http.post("/sessions", json={"task": task})).json()
    reply = await model.with_options(api_key=opened["api_key"]).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": TASKS[task]}]
    )
    text = reply.choices[0].message.content or ""
    reward = -abs(len(text) - 12) / 12
    answer = await http.post(f"/sessions/{opened['id']}/reward", json={"reward": reward})
    answer.raise_for_status()
    return reward


async def main(url: str, api_key: str, group_size: int) -> None:
    headers = {"Authorization": f"Bearer {api_key}"}
    async with (
        httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http,
        AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key) as model,
    ):
        rounds = 0
        while True:
            try:
                rewards = await asyncio.gather(
                    *(episode(http, model, task) for task in TASKS for _ in range(group_size))
                )
            except (
                httpx.HTTPError,
                APIError,
            ) as e:  # the trainer stops serving after its last step
                print(f"stopped after {rounds} rounds: {e}")
                return
            rounds += 1
            print(f"round {rounds}: mean reward {sum(rewards) / len(rewards):.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="secret")
    parser.add_argument("--group-size", type=int, default=4, help="rollout.group_size")
    args = parser.parse_args()
    asyncio.run(main(args.url, args.api_key, args.group_size))
