"""Weight syncs into a real vLLM server: reloaded weights are served, versions say which."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from served import CONTEXT, Reference, hf_logprobs, max_gap, wait_generating

from rllm_async.backends.hf_tokenizer import load_tokenizer
from rllm_async.config import CoordinatorConfig
from rllm_async.coordinator import SyncCoordinator
from rllm_async.engines.vllm import VLLMPolicy, VLLMServer, write_weights
from rllm_async.engines.vllm.engine import VLLMEngine, VLLMOptions
from rllm_async.protocols import Completion, SamplingParams
from rllm_async.rollout import RolloutContext
from rllm_async.types import TrajectoryGroup

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
TOLERANCE = 1e-3  # float32 serving against a float32 forward (test_generate.py)
LONG = SamplingParams(temperature=1.0, max_tokens=900)


@pytest.fixture(scope="module")
def weights(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served weights as written for reload (`old`), and a perturbed copy (`new`)."""
    root = tmp_path_factory.mktemp("weights")
    state = load_file(str(tiny_qwen / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    config = tiny_qwen / "config.json"
    return {
        "old": write_weights(state, root / "old", config=config),
        "new": write_weights(perturbed, root / "new", config=config),
    }


@pytest.fixture
def policy(
    servers: list[VLLMServer], tiny_qwen: Path, weights: dict[str, Path]
) -> Iterator[VLLMPolicy]:
    """A client of the first server; the server gets its original weights back afterwards."""
    tok = load_tokenizer(tiny_qwen, setting="model")
    yield VLLMPolicy([servers[0].url], tok, max_context_tokens=CONTEXT)
    restore = VLLMPolicy([servers[0].url], tok, max_context_tokens=CONTEXT)
    asyncio.run(restore.update_weights(weights["old"], 0, mode="abort"))


def prompt_of(policy: VLLMPolicy) -> list[int]:
    return policy.tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 plus 2?"}])


def test_reloaded_weights_are_served_and_the_old_ones_come_back(
    policy: VLLMPolicy, weights: dict[str, Path]
) -> None:
    prompt = prompt_of(policy)

    async def go() -> None:
        before = await policy.generate(prompt, GREEDY)
        sync = await policy.update_weights(weights["new"], 1, mode="wait")
        assert (sync.version, sync.mode, policy.acquire()) == (1, "wait", 1)
        assert 0 < sync.seconds < 5
        after = await policy.generate(prompt, GREEDY)
        assert after.versions == [1] * len(after.ids)
        expected = hf_logprobs(weights["new"], prompt, after.ids, 0.0)
        assert max(abs(a - b) for a, b in zip(after.logprobs, expected, strict=True)) < 1e-3
        assert after.logprobs != before.logprobs
        await policy.update_weights(weights["old"], 2, mode="wait")
        again = await policy.generate(prompt, GREEDY)
        assert (again.ids, again.logprobs) == (before.ids, before.logprobs)  # bit for bit
        assert again.versions == [2] * len(again.ids)
        with pytest.raises(RuntimeError, match="hold version 2"):
            await policy.generate(prompt, GREEDY, version=1)

    asyncio.run(go())


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_sync_during_requests_labels_every_token_with_its_version(
    policy: VLLMPolicy, weights: dict[str, Path], mode: str
) -> None:
    """Old tokens, then new ones, in every completion, each sampled by the weights its version
    names: the logprobs of the tokens labelled old are the old weights' and those labelled new
    the new weights' (at TOLERANCE; the weights differ by far more), in completions that span the
    sync and in the longest that do not. With `keep`, requests running at the pause go on under the new weights (their
    context recomputed), so some completions span both versions. With `abort`,
    vLLM 0.32 returns a cut request with the tokens it had or, in some runs, with none (then it
    starts again from its prompt), and the engine may finish requests before the pause reaches
    it, so spans over both versions are not asserted there."""
    prompt = prompt_of(policy)
    models = {0: Reference(weights["old"]), 1: Reference(weights["new"])}

    async def attempt() -> tuple[list[Completion], int]:
        await policy.generate(prompt, GREEDY)  # warm: the requests below start at once
        sent = sum(policy.requests_sent().values())
        # Many long requests (the random model ends some early, at its end-of-turn token): more
        # than the engine samples in the seconds its HTTP front end may take to pass the pause on.
        running = [asyncio.create_task(policy.generate(prompt, LONG)) for _ in range(128)]
        await wait_generating(policy.urls[0], tokens=128 * 4)
        assert all(policy.in_flight().values())
        sync = await policy.update_weights(weights["new"], 1, mode=mode)  # type: ignore[arg-type]
        assert sync.mode == mode
        outs = await asyncio.gather(*running)
        return outs, sum(policy.requests_sent().values()) - sent - len(running)

    def check_versions(outs: list[Completion]) -> None:
        """Each token's logprob is that of the weights its version names, in the completions
        that span the sync and in the longest ones that do not (a forward pass each)."""
        split = [out for out in outs if set(out.versions) == {0, 1}]
        whole = sorted((out for out in outs if len(set(out.versions)) == 1), key=len_of)
        for out in split[:6] + whole[-2:]:
            by_version = {v: m.logprobs(prompt, out.ids) for v, m in models.items()}
            expected = [by_version[v][i] for i, v in enumerate(out.versions)]
            assert max_gap(out.logprobs, expected) < TOLERANCE, out.versions
            assert max_gap(by_version[0], by_version[1]) > 100 * TOLERANCE  # told apart

    async def go() -> None:
        for tries in (1, 2, 3):
            outs, resent = await attempt()
            for out in outs:
                assert set(out.versions) <= {0, 1}
                assert out.versions == sorted(out.versions)  # old tokens, then new ones
                assert len(out.ids) == len(out.logprobs) == len(out.versions)
                assert out.finish_reason == "stop" or len(out.ids) == LONG.max_tokens
            check_versions(outs)
            spans = [(out.versions.count(0), out.versions.count(1)) for out in outs]
            if mode == "keep" and not any(old and new for old, new in spans) and tries < 3:
                # On a loaded machine the pause reached the engine after every request ended.
                await policy.update_weights(weights["old"], 0, mode="wait")
                continue
            if mode == "keep":
                assert resent == 0
                assert any(old and new for old, new in spans), spans
            else:
                # A request sent again was cut by the pause: all it sampled afterwards is new.
                cut = sum(1 for old, new in spans if new)
                assert resent <= cut, (resent, spans)
            return

    asyncio.run(go())


def len_of(out: Completion) -> int:
    return len(out.ids)


def test_a_keep_sync_with_seeded_requests_in_flight_waits_instead(
    policy: VLLMPolicy, weights: dict[str, Path]
) -> None:
    """Seeded requests in flight (each its own seed, so that their lengths differ and some run
    long, however fast the machine): a `keep` sync runs as `wait`."""
    prompt = prompt_of(policy)

    async def go() -> None:
        await policy.generate(prompt, GREEDY)  # warm: the requests below start at once
        running = [
            asyncio.create_task(policy.generate(prompt, LONG.updated(seed=seed)))
            for seed in range(16)
        ]
        await wait_generating(policy.urls[0], tokens=16 * 4)
        assert not all(task.done() for task in running)  # a seeded request is in flight
        sync = await policy.update_weights(weights["new"], 1, mode="keep")
        assert sync.mode == "wait"
        outs = await asyncio.gather(*running)
        # Each request ran wholly before the reload, or (queued at the pause) wholly after it.
        assert all(len(set(out.versions)) == 1 for out in outs)
        after = await policy.generate(prompt, LONG.updated(seed=5))
        assert set(after.versions) == {1}

    asyncio.run(go())


# Up to six rounds of 256 long requests: over 300 s on two cores beside other work (one CI run);
# the timeout only catches a hang.
@pytest.mark.timeout(1200)
def test_staleness_counts_the_tokens_a_sync_left_on_the_old_weights(
    policy: VLLMPolicy, weights: dict[str, Path]
) -> None:
    """Rollouts recorded through `RolloutContext` keep vLLM's per-token versions, and the
    staleness the trainer reports for their group is that of the oldest token."""
    prompt = prompt_of(policy)

    def context() -> RolloutContext:
        return RolloutContext(
            policy,
            sampling=LONG,
            pin=False,
            deadline=float("inf"),
            task_id="t",
        )

    async def go() -> None:
        await policy.generate(prompt, GREEDY)  # warm: the requests below start at once
        # Up to six syncs: on a loaded machine, sampling at temperature 1, every request of a
        # round can end before the pause lands (in one CI run, three rounds in a row).
        for version in range(1, 7):
            rollouts = [context() for _ in range(256)]  # more than finish before the pause lands
            running = [asyncio.create_task(ctx.generate(prompt)) for ctx in rollouts]
            await wait_generating(policy.urls[0], tokens=96 * 4)
            new = weights["new" if version % 2 else "old"]
            await policy.update_weights(new, version, mode="keep")
            await asyncio.gather(*running)
            split = [
                ctx.trajectory()
                for ctx in rollouts
                if set(ctx.trajectory().steps[0].versions) == {version - 1, version}
            ]
            if split:
                break
            # On a loaded machine the pause reached the engine after every request ended: again.
        assert split, [ctx.trajectory().steps[0].versions[-1] for ctx in rollouts]
        after = context()
        await after.generate(prompt, max_tokens=8)

        coordinator = SyncCoordinator(CoordinatorConfig(), 1, _no_hook, version=version)
        for traj in split:
            group = TrajectoryGroup("t", "default", [traj, after.trajectory()], [0.0, 0.0])
            assert group.min_version == version - 1
            assert coordinator.staleness(group.min_version) == 1
        steps = after.trajectory().steps
        assert steps[0].versions == [version] * len(steps[0].completion_ids)
        fresh = TrajectoryGroup("t", "default", [after.trajectory()], [0.0], dispatch_version=1)
        assert coordinator.staleness(fresh.min_version) == 0

    asyncio.run(go())


async def _no_hook(version: int) -> None:
    return None


def test_a_sync_over_two_servers_lands_on_both(
    servers: list[VLLMServer], tiny_qwen: Path, weights: dict[str, Path]
) -> None:
    """One client over both servers: after a sync each of them serves the new weights as the
    new version (greedy requests spread one per server give the new weights' logprobs)."""
    tok = load_tokenizer(tiny_qwen, setting="model")
    urls = [s.url for s in servers]
    new = Reference(weights["new"])

    async def go() -> None:
        async with VLLMPolicy(urls, tok, max_context_tokens=CONTEXT) as policy:
            prompt = prompt_of(policy)
            try:
                sync = await policy.update_weights(weights["new"], 1, mode="wait")
                assert sync.version == policy.version == 1
                sent = policy.requests_sent()
                outs = await asyncio.gather(*(policy.generate(prompt, GREEDY) for _ in urls))
                assert {u: n - sent[u] for u, n in policy.requests_sent().items()} == dict.fromkeys(
                    urls, 1
                )
                for out in outs:
                    assert out.versions == [1] * len(out.ids)
                    assert max_gap(out.logprobs, new.logprobs(prompt, out.ids, 0.0)) < TOLERANCE
            finally:
                await policy.update_weights(weights["old"], 0, mode="abort")

    asyncio.run(go())


def engine_on(
    url: str, checkpoint: Path, state: dict[str, torch.Tensor], tmp_path: Path
) -> VLLMEngine:
    """A `VLLMEngine` on a server it did not start (`vllm.urls`), starting from `state`."""
    return VLLMEngine(
        VLLMOptions(urls=[url], weights_dir=str(tmp_path / "shm")),
        checkpoint=checkpoint,
        state=state,
        tokenizer=load_tokenizer(checkpoint, setting="model"),
        max_seq_len=CONTEXT,
        run_dir=tmp_path / "run",
        mode="keep",
    )


def run_then_restore(
    engine: VLLMEngine, old: Path, body: Callable[[VLLMPolicy], Awaitable[None]]
) -> None:
    """Run `body` on the engine's policy, then give the server its `old` weights back and stop
    the engine (a server it did not start keeps running for the next test)."""

    async def go() -> None:
        try:
            await body(engine.policy)
        finally:
            await engine.policy.update_weights(old, 0, mode="abort")
            await engine.policy.close()

    try:
        asyncio.run(go())
    finally:
        engine.stop()


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def test_an_engine_on_a_running_server_reloads_its_weights_and_syncs(
    servers: list[VLLMServer], tiny_qwen: Path, weights: dict[str, Path], tmp_path: Path
) -> None:
    """`vllm.urls`: the engine's client is on the given server, the server gets the run's
    starting weights (not the ones it was started with), a sync lands, and stopping the engine
    leaves the server running."""
    server = servers[1]
    start = perturbed(load_file(str(tiny_qwen / "model.safetensors")), seed=1)
    engine = engine_on(server.url, tiny_qwen, start, tmp_path)
    started = engine.write(start)  # the starting weights, as a checkpoint for the reference
    reference = Reference(started)

    async def body(policy: VLLMPolicy) -> None:
        prompt = prompt_of(policy)
        assert policy.urls == [server.url]
        first = await policy.generate(prompt, GREEDY)
        assert first.versions == [0] * len(first.ids)
        assert max_gap(first.logprobs, reference.logprobs(prompt, first.ids, 0.0)) < TOLERANCE
        await engine.load(weights["new"], 1)
        after = await policy.generate(prompt, GREEDY)
        assert after.versions == [1] * len(after.ids)
        expected = hf_logprobs(weights["new"], prompt, after.ids, 0.0)
        assert max_gap(after.logprobs, expected) < TOLERANCE

    run_then_restore(engine, weights["old"], body)
    assert server.alive and asyncio.run(server.healthy())
    assert not any((tmp_path / "shm").iterdir()), "the engine deleted its weight files"


def test_a_tied_checkpoint_is_reloaded_with_its_output_layer(
    servers: list[VLLMServer], tmp_path: Path, weights: dict[str, Path]
) -> None:
    """A checkpoint with tied embeddings (one matrix for input and output): the engine writes
    it untied, so a sync that changes the embeddings changes the served output layer too, and
    the served logprobs are those of the tied model with the new weights."""
    from transformers import AutoModelForCausalLM

    from rllm_async.models.tiny_qwen import build_tiny_qwen

    tied = build_tiny_qwen(tmp_path / "tied", tie_word_embeddings=True)
    state = load_file(str(tied / "model.safetensors"))
    assert "lm_head.weight" not in state  # written tied: the output layer is the embeddings
    engine = engine_on(servers[1].url, tied, state, tmp_path)
    # The trained model, saved tied as transformers saves it: the reference the server must match.
    model = AutoModelForCausalLM.from_pretrained(str(tied), dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in model.parameters():  # the tied matrix once
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(str(tmp_path / "trained"))
    trained = load_file(str(tmp_path / "trained" / "model.safetensors"))
    reference = Reference(tmp_path / "trained")

    async def body(policy: VLLMPolicy) -> None:
        prompt = prompt_of(policy)
        before = await policy.generate(prompt, GREEDY)
        await engine.load(engine.write(trained), 1)
        after = await policy.generate(prompt, GREEDY)
        assert after.versions == [1] * len(after.ids)
        assert max_gap(after.logprobs, reference.logprobs(prompt, after.ids, 0.0)) < TOLERANCE
        assert after.logprobs != before.logprobs

    run_then_restore(engine, weights["old"], body)
