"""The local backend's learner: micro-batch invariance, checkpoint/resume, start-up refusals."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rllm_async.backends.local import LocalBackend
from rllm_async.backends.local.model import build_model, preset_config
from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.config import Config, ConfigError, config_from_dict
from rllm_async.protocols import Backend, SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup


def make_config(backend: dict[str, Any] | None = None, **sections: Any) -> Config:
    return config_from_dict(
        {
            "backend": {"name": "local", "max_seq_len": 64, **(backend or {})},
            "rollout": {"max_tokens": 16},
            "optim": {"lr": 0.01, "warmup_steps": 4, "schedule": "cosine"},
            "train": {"total_steps": 10, "groups_per_step": 3, "micro_batch_groups": 1},
            **sections,
        }
    )


async def sample_groups(
    backend: LocalBackend, n: int, group_size: int = 3
) -> list[TrajectoryGroup]:
    """Groups of real rollouts; different prompts give different token counts per group."""
    policy = backend.policy()
    groups = []
    for g in range(n):
        p = policy.tokenizer.apply_chat_template([{"role": "user", "content": "ab" * (g + 1)}])
        outs = [
            await policy.generate(p, SamplingParams(max_tokens=4 + 5 * g, seed=10 * g + i))
            for i in range(group_size)
        ]
        trajs = [
            Trajectory(steps=[Step(p, o.ids, o.logprobs, o.versions)], reward=float(i == g % 3))
            for i, o in enumerate(outs)
        ]
        mean = sum(t.reward for t in trajs) / group_size
        groups.append(TrajectoryGroup(f"t{g}", "default", trajs, [t.reward - mean for t in trajs]))
    return groups


def params(backend: LocalBackend) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in backend.learner.model.parameters()])


def test_presets_have_their_documented_sizes() -> None:
    vocab = CharTokenizer().vocab_size
    tiny = build_model(preset_config("tiny", vocab), seed=0).num_params()
    small = build_model(preset_config("small", vocab), seed=0).num_params()
    assert 0.08e6 < tiny < 0.15e6 and 0.8e6 < small < 1.3e6


def test_backend_protocol() -> None:
    backend = LocalBackend.from_config(make_config())
    assert isinstance(backend, Backend)
    asyncio.run(backend.close())


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_micro_batches_give_the_same_update_as_one_batch(kl_coef: float) -> None:
    cfg = make_config(algorithm={"loss": {"kl_coef": kl_coef, "opsm_kl_threshold": 0.5}})

    async def main() -> None:
        split, whole = LocalBackend.from_config(cfg), LocalBackend.from_config(cfg)
        groups = await sample_groups(split, 3)
        assert len({g.num_completion_tokens for g in groups}) == 3
        # Make the batch off-policy so clipping and importance weights are exercised.
        for b in (split, whole):
            await b.forward_backward(groups, cfg.algorithm.loss)
            await b.optim_step()
        for _ in range(2):
            for g in groups:
                m_split = await split.forward_backward([g], cfg.algorithm.loss)
            m_whole = await whole.forward_backward(groups, cfg.algorithm.loss)
            assert m_split["loss/num_tokens"] < m_whole["loss/num_tokens"]
            s, w = await split.optim_step(), await whole.optim_step()
            assert s["optim/num_tokens"] == w["optim/num_tokens"]
            assert s["optim/grad_norm"] == pytest.approx(w["optim/grad_norm"], rel=1e-4)
            assert torch.allclose(params(split), params(whole), atol=1e-6)
        await split.close()
        await whole.close()

    asyncio.run(main())


def test_resume_gives_the_same_next_step(tmp_path: Path) -> None:
    resume_round_trip(make_config(), lambda backend: sample_groups(backend, 2), tmp_path / "ckpt")


def resume_round_trip(
    cfg: Config,
    sample: Callable[[LocalBackend], Awaitable[list[TrajectoryGroup]]],
    path: Path,
) -> None:
    """Two steps, a checkpoint, a third step; a backend resumed from the checkpoint takes the
    same third step: the same weights and the same point of the learning-rate schedule."""

    async def main() -> None:
        first = LocalBackend.from_config(cfg)
        groups = await sample(first)
        for version in (1, 2):
            await first.forward_backward(groups, cfg.algorithm.loss)
            await first.optim_step()
            await first.on_policy_updated(version)
        await first.save(path)
        await first.forward_backward(groups, cfg.algorithm.loss)
        expected = await first.optim_step()

        resumed = LocalBackend.from_config(cfg)
        await resumed.load(path)
        assert resumed.policy().acquire() == 2
        await resumed.forward_backward(groups, cfg.algorithm.loss)
        got = await resumed.optim_step()
        assert got["optim/lr"] == expected["optim/lr"]  # the schedule position was restored
        assert torch.allclose(params(resumed), params(first), atol=1e-7)
        for b in (first, resumed):
            await b.close()

    asyncio.run(main())


def test_a_checkpoint_holds_the_last_optimizer_step_not_gradients_since(tmp_path: Path) -> None:
    """A run interrupted mid-step saves: the checkpoint is the last step's weights and schedule
    position, and the accumulated gradients of the interrupted step are not in it."""
    cfg = make_config()

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        groups = await sample_groups(backend, 1)
        await backend.forward_backward(groups, cfg.algorithm.loss)
        await backend.optim_step()
        stepped = params(backend).clone()
        await backend.forward_backward(groups, cfg.algorithm.loss)  # not applied
        await backend.save(tmp_path)
        resumed = LocalBackend.from_config(cfg)
        await resumed.load(tmp_path)
        assert torch.equal(params(resumed), stepped)
        assert all(p.grad is None for p in resumed.learner.model.parameters())
        assert resumed.learner.step == 1
        for b in (backend, resumed):
            await b.close()

    asyncio.run(main())


def test_optimizer_state_is_saved_rounded_or_left_out_on_request(tmp_path: Path, caplog) -> None:
    """`checkpoint_optimizer`: bfloat16 moments take about half the bytes of float32 ones and
    resume to within their rounding; `none` keeps the weights alone, and a resumed backend's
    moments start from zero, which the log says."""
    sizes, moments = {}, {}

    async def main() -> None:
        for kind in ("float32", "bfloat16", "none"):
            cfg = make_config({"checkpoint_optimizer": kind})
            backend = LocalBackend.from_config(cfg)
            await backend.forward_backward(await sample_groups(backend, 2), cfg.algorithm.loss)
            await backend.optim_step()
            await backend.save(tmp_path / kind)
            sizes[kind] = (tmp_path / kind / "local_backend.pt").stat().st_size
            resumed = LocalBackend.from_config(cfg)
            await resumed.load(tmp_path / kind)
            assert torch.equal(params(resumed), params(backend)), "weights are always exact"
            assert resumed.learner.step == 1
            moments[kind] = [
                resumed.learner.optimizer.state[p].get("exp_avg_sq")
                for p in resumed.learner.model.parameters()
            ]
            for b in (backend, resumed):
                await b.close()

    asyncio.run(main())
    weights = sizes["none"]
    assert sizes["float32"] > 2.9 * weights and sizes["bfloat16"] < 2.1 * weights
    for full, rounded in zip(moments["float32"], moments["bfloat16"], strict=True):
        assert rounded.dtype == torch.float32
        assert torch.allclose(rounded, full, rtol=1 / 128, atol=0)
    assert all(m is None for m in moments["none"])
    assert "holds weights only (backend.checkpoint_optimizer: none)" in caplog.text


@pytest.mark.parametrize(
    ("backend", "sections", "match"),
    [
        ({"modle": "tiny"}, {}, "did you mean 'model'"),
        ({"model": "huge"}, {}, "backend.model"),
        (
            {"device": "cuda:0"} if not torch.cuda.is_available() else {"device": "tpu"},
            {},
            "device",
        ),
        ({"dtype": "float16"}, {}, "float16 needs a GPU"),
        ({"max_seq_len": 16}, {}, "max_tokens"),
        ({"model_path": "/nonexistent"}, {}, "config.json"),
        ({"model": "small", "model_path": "/nonexistent"}, {}, "either"),
    ],
)
def test_refuses_what_it_cannot_honour(
    backend: dict[str, Any], sections: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        LocalBackend.from_config(make_config(backend, **sections))


def test_kl_penalty_needs_the_reference_model_from_start_up() -> None:
    cfg = make_config()

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        loss = cfg.algorithm.loss.model_copy(update={"kl_coef": 0.1})
        with pytest.raises(ValueError, match="kl_coef"):
            await backend.forward_backward(await sample_groups(backend, 1), loss)
        await backend.close()

    asyncio.run(main())


def test_trainer_reproduces_sampler_logprobs_at_the_rollout_temperature() -> None:
    cfg = make_config(rollout={"max_tokens": 16, "temperature": 0.7})

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        policy = backend.policy()
        p = policy.tokenizer.apply_chat_template([{"role": "user", "content": "on policy"}])
        outs = [
            await policy.generate(p, SamplingParams(temperature=0.7, max_tokens=16, seed=i))
            for i in range(4)
        ]
        trajs = [Trajectory(steps=[Step(p, o.ids, o.logprobs, o.versions)]) for o in outs]
        group = TrajectoryGroup("t", "default", trajs, [1.0, -1.0, 0.5, -0.5])
        m = await backend.forward_backward([group], cfg.algorithm.loss)
        assert m["loss/sampler_kl"] < 1e-8
        assert m["loss/is_weight_min"] == pytest.approx(1.0, abs=1e-4)
        assert m["loss/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
        await backend.close()

    asyncio.run(main())


def test_multi_turn_environment_tokens_are_not_trained() -> None:
    cfg = make_config()

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        policy = backend.policy()
        tok = policy.tokenizer
        first = tok.apply_chat_template([{"role": "user", "content": "turn one"}])
        a = await policy.generate(first, SamplingParams(max_tokens=5, seed=1))
        tool = tok.encode("tool says hi")
        second = first + a.ids + tool
        b = await policy.generate(second, SamplingParams(max_tokens=5, seed=2))
        steps = [
            Step(first, a.ids, a.logprobs, a.versions),
            Step(second, b.ids, b.logprobs, b.versions),
        ]
        group = TrajectoryGroup("t", "default", [Trajectory(steps=steps)], [1.0])
        m = await backend.forward_backward([group], cfg.algorithm.loss)
        assert m["loss/num_sequences"] == 1
        assert m["loss/num_tokens"] == len(a.ids) + len(b.ids)
        assert m["loss/sampler_kl"] < 1e-8  # every trained token lines up with its logprob
        await backend.close()

    asyncio.run(main())


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_is_bfloat16_where_the_cpu_computes_it_natively(monkeypatch, native) -> None:
    from rllm_async.backends.local.options import dtype_of

    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: native, raising=False)
    cpu = torch.device("cpu")
    expected = torch.bfloat16 if native else torch.float32
    assert dtype_of("auto", cpu) is expected
    backend = LocalBackend.from_config(make_config({"dtype": "auto"}))
    try:
        assert backend.dtype is expected
        assert backend.learner.compute_dtype is expected
        assert next(backend.store.get(None)[1].parameters()).dtype is expected, "the sampler's"
        assert next(backend.learner.model.parameters()).dtype is torch.float32
    finally:
        asyncio.run(backend.close())
