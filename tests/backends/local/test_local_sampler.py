"""The local sampler: logprobs match a full forward pass, dynamic batching, stops, pinned versions."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from rllm_async.backends.local import LocalBackend
from rllm_async.backends.local.cache import CacheView, KVCache
from rllm_async.backends.local.model import Transformer
from rllm_async.config import LossConfig, config_from_dict
from rllm_async.protocols import Completion, SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup


def make_backend(**options: Any) -> LocalBackend:
    cfg = config_from_dict(
        {
            "backend": {"name": "local", "max_seq_len": 96, **options},
            "rollout": {"max_tokens": 24},
            "optim": {"lr": 0.05},
        }
    )
    return LocalBackend.from_config(cfg)


def prompt(backend: LocalBackend, text: str) -> list[int]:
    return backend.policy().tokenizer.apply_chat_template([{"role": "user", "content": text}])


def full_forward_logprobs(
    model: Transformer, prompt_ids: list[int], out: Completion
) -> torch.Tensor:
    """Logprobs of the completion's tokens from one uncached forward pass over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out.ids])).float()
    logp = torch.log_softmax(logits[0, len(prompt_ids) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(out.ids).unsqueeze(-1)).squeeze(-1)


def test_logprobs_match_a_full_forward_pass_alone_and_dynamically_batched() -> None:
    async def main() -> None:
        backend = make_backend(max_batch=4)
        policy = backend.policy()
        model = backend.store.get(0)[1]
        texts = [
            "1 2 3",
            "Use 4 5 and + - * to make 20.",
            "x",
            "a longer prompt, here",
            "9*9",
            "hi",
        ]
        prompts = [prompt(backend, t) for t in texts]
        params = [SamplingParams(max_tokens=8 + 3 * i, seed=i) for i in range(len(prompts))]
        alone = [await policy.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
        assert backend.sampler.peak_batch == 1

        async def later(i: int) -> Completion:
            await asyncio.sleep(0.002 * i)  # join a batch that is already decoding
            return await policy.generate(prompts[i], params[i])

        batched = await asyncio.gather(*(later(i) for i in range(len(prompts))))
        # More requests than slots: some waited for a slot, and several decoded together.
        assert backend.sampler.peak_batch > 1
        for p, a, b in zip(prompts, alone, batched, strict=True):
            assert a.ids == b.ids  # seeded sampling does not depend on the batch
            assert b.versions == [0] * len(b.ids)
            expected = full_forward_logprobs(model, p, b)
            assert torch.allclose(torch.tensor(a.logprobs), expected, atol=1e-4)
            assert torch.allclose(torch.tensor(b.logprobs), expected, atol=1e-4)
        await backend.close()

    asyncio.run(main())


def test_requests_sharing_a_prompt_run_it_once_and_sample_apart() -> None:
    async def main() -> None:
        backend = make_backend(max_batch=8)
        policy = backend.policy()
        model = backend.store.get(0)[1]
        shared = prompt(backend, "Use 4 5 and + - * to make 20.")
        other = prompt(backend, "1 2 3")
        requests = [(shared, i) for i in range(6)] + [(other, 6), (other, 7)]
        params = {seed: SamplingParams(max_tokens=12, seed=seed) for _, seed in requests}
        alone = [await policy.generate(p, params[seed]) for p, seed in requests]
        # Admitted together: each prompt's keys and values are computed once and copied.
        together = await asyncio.gather(*(policy.generate(p, params[s]) for p, s in requests))
        assert backend.sampler.peak_batch == len(requests)
        for (p, _), a, b in zip(requests, alone, together, strict=True):
            assert a.ids == b.ids
            expected = full_forward_logprobs(model, p, b)
            assert torch.allclose(torch.tensor(b.logprobs), expected, atol=1e-4)
        # The copies are independent streams: different seeds give different completions.
        assert len({tuple(c.ids) for c in together[:6]}) > 1
        await backend.close()

    asyncio.run(main())


def test_greedy_length_stop_strings_and_seeds() -> None:
    async def main() -> None:
        backend = make_backend()
        policy, tok = backend.policy(), backend.policy().tokenizer
        p = prompt(backend, "Use 1 2 3 and + - * to make 7.")
        greedy = SamplingParams(temperature=0.0, max_tokens=20)
        a, b = await policy.generate(p, greedy), await policy.generate(p, greedy)
        assert a.ids == b.ids and a.finish_reason in ("stop", "length")
        model = backend.store.get(0)[1]
        with torch.no_grad():
            logits = model(torch.tensor([p + a.ids]))[0, len(p) - 1 : -1]
        assert logits.argmax(-1).tolist() == a.ids

        free = await policy.generate(p, SamplingParams(max_tokens=20, seed=7))
        assert free.ids == (await policy.generate(p, SamplingParams(max_tokens=20, seed=7))).ids
        assert len(free.ids) <= 20
        if free.finish_reason == "length":
            assert len(free.ids) == 20
        else:
            assert free.ids[-1] == tok.eos_token_id

        text = tok.decode(free.ids)
        stop = text[2:4]
        assert len(stop) == 2, "the seeded sample is too short for this test; change the seed"
        cut = await policy.generate(p, SamplingParams(max_tokens=20, seed=7, stop=(stop,)))
        assert cut.finish_reason == "stop"
        assert (
            tok.decode(cut.ids).endswith(stop)
            and tok.decode(cut.ids) == text[: text.find(stop) + 2]
        )

        with pytest.raises(ValueError, match="max_seq_len"):
            await policy.generate(list(range(10, 106)), greedy)
        await backend.close()

    asyncio.run(main())


def _group(prompt_ids: list[int], outs: list[Completion]) -> TrajectoryGroup:
    trajs = [Trajectory(steps=[Step(prompt_ids, o.ids, o.logprobs, o.versions)]) for o in outs]
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(outs))]
    return TrajectoryGroup("t", "default", trajs, advantages)


def test_pinned_version_keeps_old_weights_until_released() -> None:
    async def main() -> None:
        backend = make_backend()
        policy = backend.policy()
        p = prompt(backend, "pin me")
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        before = await policy.generate(p, greedy)
        pinned = policy.acquire()
        assert pinned == 0

        outs = [await policy.generate(p, SamplingParams(max_tokens=12, seed=i)) for i in range(4)]
        await backend.forward_backward([_group(p, outs)], LossConfig())
        await backend.optim_step()
        await backend.on_policy_updated(1)
        assert backend.store.versions() == [0, 1]

        old = await policy.generate(p, greedy, version=pinned)
        assert old.ids == before.ids and old.versions == [0] * len(old.ids)
        assert old.logprobs == pytest.approx(before.logprobs, abs=1e-6)
        new = await policy.generate(p, greedy)
        assert new.versions == [1] * len(new.ids)
        new_model = backend.store.get(1)[1]
        assert not torch.allclose(
            full_forward_logprobs(new_model, p, old), torch.tensor(old.logprobs), atol=1e-3
        )

        policy.release(pinned)
        assert backend.store.versions() == [1]
        with pytest.raises(ValueError, match="not in memory"):
            await policy.generate(p, greedy, version=0)
        with pytest.raises(ValueError, match="without a matching acquire"):
            policy.release(0)
        await backend.close()

    asyncio.run(main())


def test_cancelled_request_frees_its_slot_and_close_is_idempotent() -> None:
    async def main() -> None:
        backend = make_backend(max_batch=1)
        policy = backend.policy()
        p = prompt(backend, "cancel")
        # Cancel at varied moments (queued, prefilling, decoding); with one slot, a leaked slot
        # would leave the next request waiting forever.
        for i in range(30):
            task = asyncio.ensure_future(policy.generate(p, SamplingParams(max_tokens=60)))
            await asyncio.sleep(0.0005 * (i % 10))
            task.cancel()
            out = await asyncio.wait_for(policy.generate(p, SamplingParams(max_tokens=2)), 10)
            assert 1 <= len(out.ids) <= 2
        await backend.close()
        await backend.close()
        with pytest.raises(RuntimeError, match="closed"):
            await policy.generate(p, SamplingParams(max_tokens=3))

    asyncio.run(main())


def test_callers_on_event_loops_of_their_own_share_the_sampler() -> None:
    """Each caller's completions come back on its own loop; one whose loop closed while it waited
    does not stop the sampler from serving the others."""
    backend = make_backend(max_batch=8)
    policy = backend.policy()
    p = prompt(backend, "two loops")
    params = [SamplingParams(max_tokens=8, seed=i) for i in range(4)]

    abandoned = asyncio.new_event_loop()
    pending = abandoned.create_task(policy.generate(p, SamplingParams(max_tokens=1)))
    # The decode thread waits on the sampler's lock (re-entrant: this thread queues under it)
    # until the loop is closed, so that the completion can no longer be delivered, however fast.
    with backend.sampler._wake:
        abandoned.run_until_complete(asyncio.sleep(0))  # the request is queued
        abandoned.close()

    results: dict[str, list[Completion]] = {}
    start = threading.Barrier(2)

    def caller(name: str) -> None:
        async def main() -> None:
            start.wait()  # both loops queue their requests at about the same time
            results[name] = await asyncio.wait_for(
                asyncio.gather(*(policy.generate(p, q) for q in params)), 30
            )

        asyncio.run(main())

    threads = [threading.Thread(target=caller, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == ["a", "b"]
    # The same seeds give the same tokens on either loop, whatever the batch.
    assert [c.ids for c in results["a"]] == [c.ids for c in results["b"]]
    assert all(1 <= len(c.ids) <= 8 for c in results["a"])
    assert not pending.done()
    asyncio.run(backend.close())


def test_free_slots_go_to_lower_priority_values_first_then_in_arrival_order() -> None:
    """Among requests queued together; see the next test for requests queued apart."""

    async def main() -> None:
        backend = make_backend(max_batch=1)  # one slot: requests are admitted one at a time
        policy = backend.policy()
        p = prompt(backend, "priority")
        order: list[int] = []
        priorities = [1, 0, 1, 0, 0, 1, 1, 0]
        # The decode thread cannot admit anything while we hold its lock (reentrant for us), so
        # every request is queued before the first is admitted.
        with backend.sampler._wake:
            calls = []
            for i, priority in enumerate(priorities):
                params = SamplingParams(max_tokens=2, seed=i, priority=priority)
                call = asyncio.ensure_future(policy.generate(p, params))
                call.add_done_callback(lambda _, i=i: order.append(i))
                calls.append(call)
            await asyncio.sleep(0)  # each call queues its request
        await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert order == [1, 3, 4, 7, 0, 2, 5, 6]
        await backend.close()

    asyncio.run(main())


def test_a_lower_priority_request_goes_first_once_it_has_waited_its_delay(monkeypatch) -> None:
    """A steady stream of rollouts cannot starve an evaluation's request: it ranks as if it had
    arrived `PRIORITY_DELAY_S` later, so rollouts queued after that go behind it."""
    from rllm_async.backends.local import sampler as sampler_module

    clock = [100.0]
    monkeypatch.setattr(sampler_module.time, "monotonic", lambda: clock[0])

    async def main() -> None:
        backend = make_backend(max_batch=1)
        policy = backend.policy()
        p = prompt(backend, "priority")
        order: list[str] = []
        with backend.sampler._wake:  # nothing is admitted until every request is queued
            calls = []
            delay = sampler_module.PRIORITY_DELAY_S
            for name, priority, after in [("eval", 1, 0.0), ("early", 0, 0.5), ("late", 0, 1.5)]:
                clock[0] = 100.0 + after * delay
                params = SamplingParams(max_tokens=2, seed=0, priority=priority)
                call = asyncio.ensure_future(policy.generate(p, params))
                call.add_done_callback(lambda _, name=name: order.append(name))
                calls.append(call)
                await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert order == ["early", "eval", "late"]
        await backend.close()

    asyncio.run(main())


def test_batched_sampling_follows_the_distribution_and_top_p() -> None:
    import random

    import torch

    from rllm_async.backends.local.sampler import sample_tokens
    from rllm_async.protocols import SamplingParams

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    rng = random.Random(0)
    n = 20_000
    draws = [
        sample_tokens(logits, [SamplingParams(temperature=1.0)], [rng.random()])[0][0]
        for _ in range(n)
    ]
    expected = torch.softmax(logits[0], -1)
    for token in range(4):
        assert abs(draws.count(token) / n - float(expected[token])) < 0.015
    # top_p = 0.7 keeps the two most likely tokens (0.64 + 0.24 >= 0.7), never the tail.
    top = [
        sample_tokens(logits, [SamplingParams(top_p=0.7)], [rng.random()])[0][0]
        for _ in range(2000)
    ]
    assert set(top) == {0, 1}
    # Logprobs are after temperature, before top-p; greedy uses the raw logits.
    tokens, lps = sample_tokens(
        logits.repeat(2, 1),
        [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)],
        [0.99, 0.5],
    )
    assert tokens[1] == 0 and abs(lps[1] - float(torch.log_softmax(logits[0], -1)[0])) < 1e-6
    assert abs(lps[0] - float(torch.log_softmax(logits[0] / 0.5, -1)[tokens[0]])) < 1e-6


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch() -> None:
    import asyncio

    import torch

    from rllm_async.backends.local.model import build_model, frozen_copy, preset_config
    from rllm_async.backends.local.sampler import Sampler
    from rllm_async.backends.local.snapshots import WeightStore
    from rllm_async.backends.toy_tokenizers import CharTokenizer
    from rllm_async.protocols import SamplingParams

    tok = CharTokenizer()
    model = build_model(preset_config("tiny", tok.vocab_size), seed=0)
    store = WeightStore(0, frozen_copy(model, torch.device("cpu"), torch.float32))
    sampler = Sampler(
        store,
        tok,
        (),
        max_batch=16,
        max_seq_len=40,
        device=torch.device("cpu"),
        dtype=torch.float32,
        threads=1,
        seed=0,
    )
    seeded = SamplingParams(max_tokens=12, seed=123)

    async def alone() -> list[int]:
        return (await sampler.generate(tok.encode("hi"), seeded)).ids

    async def crowded() -> list[int]:
        others = [
            sampler.generate(tok.encode(f"x{i}"), SamplingParams(max_tokens=12)) for i in range(8)
        ]
        outs = await asyncio.gather(sampler.generate(tok.encode("hi"), seeded), *others)
        return outs[0].ids

    try:
        assert asyncio.run(alone()) == asyncio.run(crowded())
    finally:
        sampler.close()


@pytest.mark.parametrize(
    "slots",
    [[1, 2, 3], [0, 2, 3], [3, 1, 2], [0, 3, 7]],
    ids=["consecutive", "spread", "unordered", "gathered"],
)
def test_cache_view_writes_and_attends_over_each_rows_own_slot(slots: list[int]) -> None:
    """Rows at different positions, spanning several cache blocks, with grouped-query heads;
    however the batch's slots lie (a run, a run with gaps, out of order, far apart)."""
    cache = KVCache(
        n_layers=1, max_batch=8, n_kv_heads=2, max_seq_len=40, head_dim=4,
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    cache.k.normal_()
    cache.v.normal_()
    positions = torch.tensor([[21], [2], [35]])
    view = CacheView(cache, torch.tensor(slots), positions)
    q = torch.randn(3, 4, 1, 4)  # 4 query heads share 2 key/value heads
    k_new, v_new = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    out = view.attend(0, q, k_new, v_new)
    assert out.shape == (3, 4, 1, 4)
    for row, (slot, pos) in enumerate(zip(slots, positions[:, 0].tolist(), strict=True)):
        # The slot's history as [kv_heads, positions, head_dim], written token included.
        keys = cache.k[0, :, slot].permute(1, 0, 2, 3).reshape(2, -1, 4)[:, : pos + 1]
        values = cache.v[0, :, slot].permute(1, 0, 2, 3).reshape(2, -1, 4)[:, : pos + 1]
        assert torch.equal(keys[:, pos], k_new[row, :, 0])
        assert torch.equal(values[:, pos], v_new[row, :, 0])
        keys, values = keys.repeat_interleave(2, 0), values.repeat_interleave(2, 0)
        probs = torch.softmax(q[row, :, 0:1] @ keys.transpose(-1, -2) / 2.0, dim=-1)
        torch.testing.assert_close(out[row], probs @ values)
