"""`rollout: verl-vllm` end to end on the CPU: verl's server manager, router, client and weight
sync.

The servers are `server_stub.StubServer` (the only fake: vLLM cannot run here), registered under
verl's name `vllm`. Everything else is real: two FSDP training workers holding verl's rollout
adapters (role `actor_rollout`), verl's hybrid replicas built by `LLMServerManager`, its sticky
router and `LLMServerClient`, and `CheckpointEngineManager` with verl's in-process `naive` engine
(`update_weights` on the workers). The CPU cannot run cuda servers, so the backend is built past
`check_config`'s device check (which the options tests cover).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import server_stub  # registers the stand-in under verl's name `vllm`

from rllm_async.backends.verl.backend import VerlBackend
from rllm_async.backends.verl.options import VerlOptions
from rllm_async.config import config_from_dict, validate_options
from rllm_async.protocols import SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def backend(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One backend for the module: 2 CPU workers, so 2 replicas (tensor_parallel_size 1)."""
    path = os.pathsep.join(
        [str(Path(server_stub.__file__).parent), os.environ.get("PYTHONPATH", "")]
    )
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    cfg = config_from_dict(
        {
            "run_dir": str(tmp_path_factory.mktemp("run")),
            "backend": {
                "name": "verl",
                "model_path": str(tiny_checkpoint),
                "device": "cpu",
                "gpus_per_node": 2,
                "rollout": "verl-vllm",
                "max_seq_len": 96,
                "overrides": ["model.external_lib=server_stub"],
            },
            "rollout": {"max_tokens": 8},
            "coordinator": {"weight_update": "latest"},
            "optim": {"lr": 0.05, "grad_clip": None},
        }
    )
    opts = validate_options(VerlOptions, cfg.backend.options, "backend")
    instance = VerlBackend(cfg, opts)
    try:
        yield instance
    finally:
        asyncio.run(instance.close())
        ray.shutdown()


def servers(backend: Any) -> list[Any]:
    return [r.servers[0] for r in backend.rollout.manager.get_replicas()]


def server_states(backend: Any) -> list[dict[str, Any]]:
    return ray.get([s.state.remote() for s in servers(backend)])


def prompt(backend: Any, text: str) -> list[int]:
    return backend.policy().tokenizer.apply_chat_template([{"role": "user", "content": text}])


async def sample_groups(backend: Any, seed: int) -> list[TrajectoryGroup]:
    """Two groups of four completions, rewards alternating so every group has signal."""
    policy = backend.policy()
    groups = []
    for g in range(2):
        ids = prompt(backend, "ab" * (g + 1))
        outs = [
            await policy.generate(ids, SamplingParams(1.0, max_tokens=6, seed=seed + 10 * g + i))
            for i in range(4)
        ]
        trajs = [
            Trajectory([Step(ids, o.ids, o.logprobs, o.versions)], reward=float(i % 2))
            for i, o in enumerate(outs)
        ]
        groups.append(TrajectoryGroup(f"t{g}", "default", trajs, [r - 0.5 for r in (0, 1, 0, 1)]))
    return groups


def versions(groups: list[TrajectoryGroup]) -> set[int]:
    return {v for g in groups for t in g.trajectories for s in t.steps for v in s.versions}


def test_servers_sample_with_the_trained_weights_after_every_sync(backend: Any) -> None:
    """The servers start with random (dummy) weights; after the initial sync and after an update
    their logprobs are the trainer's on the same tokens, and the old samples no longer are."""
    loss = backend.config.algorithm.loss

    async def main() -> None:
        before = await sample_groups(backend, seed=0)
        assert versions(before) == {0}
        await backend.forward_backward(before, loss)
        first = await backend.optim_step()
        assert first["loss/sampler_kl"] < 1e-6, first
        assert first["optim/grad_norm"] > 0

        await backend.on_policy_updated(1)
        assert [s["global_steps"] for s in server_states(backend)] == [1, 1]
        assert all(s["asleep"] == [] for s in server_states(backend))
        after = await sample_groups(backend, seed=0)
        assert versions(after) == {1}
        await backend.forward_backward(after, loss)
        second = await backend.optim_step()
        assert second["loss/sampler_kl"] < 1e-6, second

        await backend.forward_backward(before, loss)  # version-0 samples, trainer two steps on
        stale = await backend.optim_step()
        assert stale["loss/sampler_kl"] > 1e-3, stale
        await backend.on_policy_updated(2)

    asyncio.run(main())


def test_turns_of_an_episode_stay_on_one_server(backend: Any) -> None:
    """verl's router keeps each episode (one asyncio task) on one server; episodes spread out.

    First turns run together (the router spreads them by load); later turns run one at a time,
    so without sticky sessions each would go to either server at random (both idle).
    """
    policy = backend.policy()
    starts = {i: prompt(backend, f"episode {i}") for i in range(8)}

    async def main() -> None:
        one_at_a_time = asyncio.Lock()

        async def episode(i: int) -> None:
            ids = list(starts[i])
            for turn in range(3):
                params = SamplingParams(1.0, max_tokens=4, seed=i)
                if turn == 0:
                    out = await policy.generate(ids, params)
                else:
                    async with one_at_a_time:
                        out = await policy.generate(ids, params)
                ids = ids + out.ids + prompt(backend, "more")[1:]

        await asyncio.gather(*(episode(i) for i in range(8)))

    seen = [len(s["log"]) for s in server_states(backend)]
    asyncio.run(main())
    served: dict[int, set[int]] = {i: set() for i in starts}
    calls = 0
    for rank, state in enumerate(server_states(backend)):
        for entry in state["log"][seen[rank] :]:
            owner = [i for i, p in starts.items() if entry["prompt"][: len(p)] == p]
            assert len(owner) == 1
            served[owner[0]].add(rank)
            calls += 1
    assert calls == 24
    assert all(len(ranks) == 1 for ranks in served.values()), served
    assert {r for ranks in served.values() for r in ranks} == {0, 1}


def test_sampling_params_reach_the_server(backend: Any) -> None:
    """max_tokens, stop strings and seeds are honoured; logprobs and versions come per token."""
    policy = backend.policy()
    ids = prompt(backend, "count")
    stop = tuple("aeiou0123456789")

    async def main() -> tuple[list[Any], list[Any], list[Any]]:
        capped = [
            await policy.generate(ids, SamplingParams(1.0, max_tokens=5, seed=s)) for s in range(6)
        ]
        stopped = [
            await policy.generate(ids, SamplingParams(1.0, max_tokens=40, stop=stop, seed=s))
            for s in range(6)
        ]
        again = [
            await policy.generate(ids, SamplingParams(1.0, max_tokens=5, seed=s)) for s in range(6)
        ]
        return capped, stopped, again

    capped, stopped, again = asyncio.run(main())
    tok = policy.tokenizer
    for out in capped:
        assert 1 <= len(out.ids) <= 5
        assert len(out.logprobs) == len(out.versions) == len(out.ids)
        assert all(lp <= 0 for lp in out.logprobs)
        assert set(out.versions) == {policy.version}
        assert out.finish_reason == ("length" if len(out.ids) == 5 else "stop")
    assert any(out.finish_reason == "length" for out in capped)
    assert [o.ids for o in again] == [o.ids for o in capped]  # same seed, same tokens
    assert len({tuple(o.ids) for o in capped}) > 1  # different seeds, different tokens
    cut = [
        o
        for o in stopped
        if o.finish_reason == "stop" and any(c in tok.decode(o.ids) for c in stop)
    ]
    assert cut
    for out in cut:  # the stop string ends the completion: it is in the last token only
        assert not any(c in tok.decode(out.ids[:-1]) for c in stop)


def test_a_sync_mid_request_resumes_it_with_the_new_weights(backend: Any) -> None:
    """A request cut by a weight sync goes on from its tokens; each token keeps its version."""
    policy = backend.policy()
    ids = prompt(backend, "long")
    old = policy.version

    def delay(seconds: float) -> None:
        ray.get([s.set_token_delay.remote(seconds) for s in servers(backend)])

    def started() -> bool:
        return any(
            e["ids"] and e["prompt"] == ids for s in server_states(backend) for e in s["log"]
        )

    async def main() -> Any:
        delay(2.0)  # the request waits after its first token: the sync lands there
        request = asyncio.create_task(
            policy.generate(ids, SamplingParams(1.0, max_tokens=12, seed=3))
        )
        while not started():
            await asyncio.sleep(0.05)
        await backend.on_policy_updated(old + 1)
        delay(0.0)
        return await request

    try:
        out = asyncio.run(main())
    finally:
        delay(0.0)
    entries = [
        e for s in server_states(backend) for e in s["log"] if e["prompt"][: len(ids)] == ids
    ]
    assert [e["aborted"] for e in entries] == [True, False]
    k = len(entries[0]["ids"])
    assert entries[1]["prompt"] == ids + entries[0]["ids"]
    assert out.ids == entries[0]["ids"] + entries[1]["ids"]
    assert 0 < k < len(out.ids)
    assert out.versions == [old] * k + [old + 1] * (len(out.ids) - k)


def test_a_pinned_version_the_servers_no_longer_hold_is_refused(backend: Any) -> None:
    policy = backend.policy()
    stale = policy.version - 1
    with pytest.raises(RuntimeError, match="weight_update: latest"):
        asyncio.run(policy.generate(prompt(backend, "x"), SamplingParams(), version=stale))
