"""The Tinker backend without a server: SDK compatibility layer (real SDK types), training data,
loss normalization, refusals, credentials and an unreachable server.

Runs under whichever `tinker` SDK is installed: the current one in the main environment, 0.24.1
in .venv-skyrl (see docs/tinker.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rllm_async.algorithms.schedule import learning_rate
from rllm_async.backends.tinker.data import StepNormalizer, examples, loss_stats
from rllm_async.backends.tinker.options import check_config, loss_fn_config
from rllm_async.config import ConfigError, LossConfig, OptimConfig, config_from_dict, load_config
from rllm_async.protocols import SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup

try:
    import tinker

    from rllm_async.backends.tinker import sdk
    from rllm_async.backends.tinker.policy import TinkerPolicy
except ImportError:
    tinker = None

needs_sdk = pytest.mark.skipif(
    tinker is None, reason="the tinker SDK is not installed: pip install 'rllm-async[tinker]'"
)

MODEL_DIR = Path(__file__).resolve().parents[3] / ".tinker-server" / "model"


def tinker_config(**backend: object) -> dict:
    return {
        "backend": {"name": "tinker", "base_model": "Qwen/Qwen3-8B", **backend},
        "algorithm": {"loss": {"importance_sampling": "none"}},
    }


def group(task: str, advantages: list[float], turns: int = 1) -> TrajectoryGroup:
    """Trajectories of `turns` steps; each later prompt extends the previous prompt + completion."""
    trajs = []
    for i, _ in enumerate(advantages):
        steps, prompt = [], [1, 2, 3]
        for t in range(turns):
            completion = [10 + i, 20 + t]
            steps.append(Step(prompt, completion, [-0.5, -0.25], [0, 0]))
            prompt = [*prompt, *completion, 7, 8]  # 7, 8: a tool's reply
        trajs.append(Trajectory(steps=steps, reward=advantages[i]))
    return TrajectoryGroup(task, "default", trajs, advantages)


# -- the compatibility layer, with the SDK's own types -----------------------------------------


@needs_sdk
def test_sdk_version_decides_the_futures_api() -> None:
    assert sdk.sdk_version("0.24.1") == (0, 24, 1)
    assert sdk.sdk_version("0.38.0+local") == (0, 38, 0)
    assert sdk.FUTURES_API is (sdk.sdk_version() >= (0, 38))


@needs_sdk
def test_call_awaits_sdk_futures_concurrent_futures_coroutines_and_values() -> None:
    from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

    async def main() -> list[object]:
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        done.set_result(1)
        api: concurrent.futures.Future[int] = concurrent.futures.Future()
        api.set_result(2)

        async def coro() -> int:
            return 3

        return [
            await sdk.call("a", done, 5),
            await sdk.call("b", AwaitableConcurrentFuture(api), 5),
            await sdk.call("c", coro(), 5),
            await sdk.call("d", 4, 5),
        ]

    assert asyncio.run(main()) == [1, 2, 3, 4]


@needs_sdk
def test_call_times_out_with_the_operation_named() -> None:
    async def main() -> None:
        never: concurrent.futures.Future[int] = concurrent.futures.Future()
        await sdk.call("forward_backward", never, 0.2)

    t0 = time.monotonic()
    with pytest.raises(sdk.TinkerBackendError, match=r"forward_backward did not finish within"):
        asyncio.run(main())
    assert time.monotonic() - t0 < 5


@needs_sdk
def test_call_reports_a_rejected_request() -> None:
    import httpx

    response = httpx.Response(400, request=httpx.Request("POST", "http://127.0.0.1/x"))
    error = tinker.BadRequestError(
        "LoRA rank 64 must be between 1 and 32", response=response, body=None
    )

    async def main() -> None:
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        future.set_exception(error)
        await sdk.call("create_lora_training_client", future, 5)

    with pytest.raises(
        sdk.TinkerBackendError, match=r"rejected create_lora_training_client \(HTTP 400\)"
    ):
        asyncio.run(main())


@needs_sdk
def test_datum_adam_and_sampling_params_are_real_sdk_types() -> None:
    d = sdk.datum([1, 2, 3], [2, 3, 4], [0.0, -1.0, -2.0], [0.0, 0.5, 0.5])
    assert isinstance(d, tinker.types.Datum)
    assert d.model_input.to_ints() == [1, 2, 3]
    inputs = d.loss_fn_inputs
    assert inputs["target_tokens"].tolist() == [2, 3, 4]
    assert inputs["target_tokens"].dtype == "int64"
    assert inputs["advantages"].tolist() == [0.0, 0.5, 0.5]
    adam = sdk.adam_params(1e-3, (0.9, 0.99), 0.01, None)
    assert isinstance(adam, tinker.types.AdamParams)
    assert (adam.beta2, adam.weight_decay, adam.grad_clip_norm) == (0.99, 0.01, 0.0)
    assert sdk.adam_params(1e-3, (0.9, 0.99), 0.0, 1.0).grad_clip_norm == 1.0
    params = sdk.sampling_params(16, 0.7, 0.9, 3, [2])
    assert isinstance(params, tinker.types.SamplingParams)
    assert (params.max_tokens, params.stop, params.seed) == (16, [2], 3)


@needs_sdk
def test_outputs_are_read_from_real_sdk_responses() -> None:
    logprobs = tinker.types.TensorData(data=[-0.5, -1.5], dtype="float32", shape=[2])
    out = tinker.types.ForwardBackwardOutput(
        loss_fn_output_type="TensorData", loss_fn_outputs=[{"logprobs": logprobs}], metrics={}
    )
    assert sdk.output_logprobs(out) == [[-0.5, -1.5]]
    step = tinker.types.OptimStepResponse(metrics={"grad_norm": 2.0})
    assert sdk.optim_metrics(step) == {"grad_norm": 2.0}
    assert sdk.optim_metrics(tinker.types.OptimStepResponse()) == {}


# -- the policy client: one snapshot sampler per live version ----------------------------------


class FakeSampler:
    """Answers every sample with `token`, like an SDK sampling client pinned to some weights."""

    def __init__(self, token: int) -> None:
        self.token = token

    def sample(self, prompt: object, num_samples: int, sampling_params: object) -> object:
        seq = SimpleNamespace(tokens=[self.token], logprobs=[-1.0], stop_reason="stop")
        done: concurrent.futures.Future[object] = concurrent.futures.Future()
        done.set_result(SimpleNamespace(sequences=[seq]))
        return done


def make_policy(snapshots: bool = True) -> Any:
    async def started() -> None:
        return None

    tok = SimpleNamespace(eos_token_id=2, eos_token="<|im_end|>")
    policy = TinkerPolicy(tok, started, timeout_s=5, snapshots=snapshots)  # type: ignore[arg-type]
    policy.publish(0, FakeSampler(100))
    return policy


@needs_sdk
def test_pinned_versions_keep_their_sampler_until_released() -> None:
    policy = make_policy()
    params = SamplingParams(max_tokens=4)

    async def main() -> None:
        pinned = policy.acquire()
        policy.publish(1, FakeSampler(101))
        assert policy.live_versions == [0, 1]
        old = await policy.generate([1], params, version=pinned)
        new = await policy.generate([1], params)
        assert (old.ids, old.versions, new.ids, new.versions) == ([100], [0], [101], [1])
        policy.release(pinned)
        assert policy.live_versions == [1]
        with pytest.raises(KeyError, match="version 0 is not live"):
            await policy.generate([1], params, version=0)
        with pytest.raises(ValueError, match="without a matching acquire"):
            policy.release(0)

    asyncio.run(main())


@needs_sdk
def test_without_server_snapshots_an_older_version_is_refused() -> None:
    policy = make_policy(snapshots=False)
    pinned = policy.acquire()
    policy.publish(1, FakeSampler(101))
    with pytest.raises(RuntimeError, match="not snapshots"):
        asyncio.run(policy.generate([1], SamplingParams(), version=pinned))


class SlowSampler(FakeSampler):
    """Answers when the test says so, to hold a sample call in flight."""

    def __init__(self, token: int) -> None:
        super().__init__(token)
        self.calls: list[concurrent.futures.Future[object]] = []

    def sample(self, prompt: object, num_samples: int, sampling_params: object) -> object:
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self.calls.append(future)
        return future

    def answer(self) -> None:
        seq = SimpleNamespace(tokens=[self.token], logprobs=[-1.0], stop_reason="stop")
        self.calls.pop(0).set_result(SimpleNamespace(sequences=[seq]))


@needs_sdk
def test_without_snapshots_weights_never_change_under_a_sample_call() -> None:
    """freeze() (before an optimizer step) waits for the sample calls in flight and holds new ones
    until the next publish, so each completion is tagged with the version that produced it."""
    slow = SlowSampler(100)
    policy = make_policy(snapshots=False)
    policy.publish(0, slow)
    params = SamplingParams(max_tokens=4)

    async def main() -> None:
        running = asyncio.create_task(policy.generate([1], params))
        await asyncio.sleep(0.01)
        assert len(slow.calls) == 1
        freeze = asyncio.create_task(policy.freeze())
        await asyncio.sleep(0.01)
        assert not freeze.done()  # the optimizer step waits for the call in flight
        later = asyncio.create_task(policy.generate([1], params))
        await asyncio.sleep(0.01)
        assert len(slow.calls) == 1  # a new call waits while frozen
        slow.answer()
        await freeze
        assert (await running).versions == [0]
        await asyncio.sleep(0.01)
        assert not later.done() and not slow.calls
        policy.publish(1, FakeSampler(101))  # the weight sync after the step
        out = await later
        assert (out.ids, out.versions) == ([101], [1])

    asyncio.run(main())


@needs_sdk
def test_with_snapshots_sampling_never_waits_for_an_optimizer_step() -> None:
    policy = make_policy()

    async def main() -> None:
        await policy.freeze()
        out = await asyncio.wait_for(policy.generate([1], SamplingParams()), 1)
        assert out.versions == [0]

    asyncio.run(main())


@needs_sdk
def test_stop_is_eos_token_or_strings_plus_eos_text() -> None:
    policy = make_policy()
    assert policy._sdk_params(SamplingParams()).stop == [2]
    assert policy._sdk_params(SamplingParams(stop=("\n\n",))).stop == ["\n\n", "<|im_end|>"]


# -- credentials, reachability, refusals -------------------------------------------------------


@needs_sdk
def test_missing_api_key_is_a_clear_config_error(monkeypatch, tmp_path) -> None:
    for var in ("TINKER_API_KEY", "TINKER_CREDENTIAL_CMD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    from rllm_async.backends.tinker import TinkerBackend

    with pytest.raises(ConfigError, match="TINKER_API_KEY"):
        TinkerBackend.from_config(config_from_dict(tinker_config()))


@needs_sdk
def test_closed_port_fails_fast_with_bounded_retries(monkeypatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends
    t0 = time.monotonic()
    with pytest.raises(
        sdk.TinkerBackendError, match=rf"cannot reach .*127.0.0.1:{port}.* 3 attempts"
    ):
        sdk.wait_reachable(f"http://127.0.0.1:{port}", timeout_s=1.0, attempts=3)
    assert time.monotonic() - t0 < 5  # backoff 0.5 s + 1 s, then the error


@needs_sdk
@pytest.mark.skipif(not MODEL_DIR.is_dir(), reason="needs the tiny model: manage.py build-model")
def test_backend_refuses_a_closed_port_at_start_up(monkeypatch) -> None:
    from rllm_async.backends.tinker import TinkerBackend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tinker_config(
        base_model=str(MODEL_DIR), base_url=f"http://127.0.0.1:{port}", api_key="tml-test"
    )
    t0 = time.monotonic()
    with pytest.raises(sdk.TinkerBackendError, match="cannot reach the Tinker server"):
        TinkerBackend.from_config(config_from_dict(cfg))
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize(
    ("loss", "named"),
    [
        ({"kl_coef": 0.1}, "kl_coef is 0.1"),
        ({"importance_sampling": "token_truncate"}, "importance_sampling is token_truncate"),
        ({"importance_sampling": "sequence_mask"}, "set it to none"),
        ({"opsm_kl_threshold": 0.5}, "opsm_kl_threshold"),
        (
            {"behaviour_logprobs": "recomputed"},
            "behaviour_logprobs is recomputed.*set it to sampler",
        ),
    ],
)
def test_unsupported_loss_options_are_refused_with_what_to_use(loss, named) -> None:
    cfg = tinker_config()
    cfg["algorithm"]["loss"].update(loss)
    with pytest.raises(ConfigError, match=named) as e:
        check_config(config_from_dict(cfg))
    assert "backend.name: local" in str(e.value)


def test_the_default_loss_config_is_refused_for_its_importance_sampling() -> None:
    cfg = tinker_config()
    del cfg["algorithm"]
    with pytest.raises(ConfigError, match="importance_sampling is token_truncate"):
        check_config(config_from_dict(cfg))


def test_servers_without_snapshots_sample_only_the_newest_weights() -> None:
    cfg = tinker_config(server_snapshots=False)
    with pytest.raises(ConfigError, match="pipeline_depth is 1 with weight_update: pin") as e:
        check_config(config_from_dict(cfg))
    assert "weight_update: latest" in str(e.value) and "snapshots" in str(e.value)
    check_config(config_from_dict({**cfg, "mode": "sync"}))
    latest = {"pipeline_depth": 2, "max_staleness": 2, "weight_update": "latest"}
    check_config(config_from_dict({**cfg, "coordinator": latest}))
    pinned_on_policy = {"pipeline_depth": 0, "weight_update": "pin"}
    check_config(config_from_dict({**cfg, "coordinator": pinned_on_policy}))
    # Servers with snapshots take any schedule.
    check_config(config_from_dict(tinker_config()))


def test_servers_without_snapshots_refuse_a_sync_interval() -> None:
    every = {"sync_every": 2, "max_staleness": 2, "weight_update": "latest"}
    cfg = tinker_config(server_snapshots=False)
    with pytest.raises(ConfigError, match=r"cannot lag by coordinator.sync_every \(2\)"):
        check_config(config_from_dict({**cfg, "coordinator": every}))
    check_config(config_from_dict({**tinker_config(), "coordinator": every}))


def test_unknown_and_missing_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="did you mean 'lora_rank'"):
        check_config(config_from_dict(tinker_config(lora_rnak=8)))
    cfg = tinker_config()
    del cfg["backend"]["base_model"]
    with pytest.raises(ConfigError, match=r"backend\.base_model"):
        check_config(config_from_dict(cfg))


@pytest.mark.parametrize("name", ["ppo_clip", "importance_sampling", "cispo"])
def test_each_loss_maps_to_a_builtin_with_ratio_thresholds(name) -> None:
    cfg = tinker_config()
    cfg["algorithm"]["loss"].update(name=name, clip_low=0.2, clip_high=0.28)
    check_config(config_from_dict(cfg))
    loss = config_from_dict(cfg).algorithm.loss
    expected = None if name == "importance_sampling" else (0.8, 1.28)
    got = loss_fn_config(loss)
    assert (None if got is None else tuple(round(v, 6) for v in got.values())) == expected


# -- training data and normalization -----------------------------------------------------------


def test_examples_shift_targets_and_weigh_only_sampled_tokens() -> None:
    (e,) = examples([group("t", [0.5], turns=2)])
    # tokens: prompt 1 2 3 | 10 20 | tool 7 8 | 10 21
    assert e.inputs == [1, 2, 3, 10, 20, 7, 8, 10]
    assert e.targets == [2, 3, 10, 20, 7, 8, 10, 21]
    assert e.mask == [0, 0, 1, 1, 0, 0, 1, 1]
    assert e.logprobs == [0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -0.5, -0.25]
    assert e.sent_advantages() == [0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.5, 0.5]


def test_the_steps_token_mean_holds_whatever_the_micro_batch_split() -> None:
    """Per-token weights are one constant per step, so the split changes nothing."""
    groups = [group(f"t{i}", [1.0, -1.0], turns=1 + i % 2) for i in range(4)]

    def weights(split: int) -> list[float]:
        norm = StepNormalizer(groups_per_step=4, reduction="sum")
        norm.per_group = (6.0, 2.0)  # as learnt from a previous step
        out = []
        for k in range(0, 4, split):
            batch = examples(groups[k : k + split])
            norm.weigh(groups[k : k + split], batch)
            out += [e.weight for e in batch]
        assert norm.close_step()["tinker/grad_scale_error"] == pytest.approx(24 / 24)
        return out

    assert weights(1) == weights(4)
    assert set(weights(2)) == {1 / 24}


def test_first_step_estimates_from_its_first_micro_batch_and_reports_the_error() -> None:
    norm = StepNormalizer(groups_per_step=2, reduction="sum")
    short, long = group("a", [1.0, -1.0]), group("b", [1.0, -1.0], turns=3)
    norm.weigh([short], first := examples([short]))
    norm.weigh([long], examples([long]))
    assert first[0].weight == 1 / 8  # 4 loss tokens in the first group, 2 groups per step
    metrics = norm.close_step()
    assert metrics["tinker/grad_scale_error"] == pytest.approx((4 + 12) / 8)
    assert norm.per_group == (8.0, 2.0)


def test_sequence_mean_servers_get_the_length_folded_back_in() -> None:
    norm = StepNormalizer(groups_per_step=1, reduction="sequence_mean")
    g = group("a", [1.0, -1.0], turns=2)
    batch = examples([g])
    norm.weigh([g], batch)
    # The server divides each sequence by its length, then by the number of sequences: undo both.
    assert batch[0].weight == pytest.approx(len(batch[0].targets) * 2 / 8)
    assert norm.close_step()["tinker/grad_scale_error"] == pytest.approx(1.0)


def test_loss_stats_match_the_shared_loss_on_the_servers_logprobs() -> None:
    batch = examples([group("a", [1.0, -1.0])])  # sampler logprobs -0.5, -0.25 on both
    learner = [[0.0, 0.0, -0.5, -0.25], [0.0, 0.0, -0.1, -0.9]]
    stats = loss_stats(batch, learner, LossConfig(importance_sampling="none")).metrics()
    assert stats["loss/num_tokens"] == 4 and stats["loss/num_sequences"] == 2
    # A=+1, ratio 1: -1 per token. A=-1: max(r, clip(r, 0.8, 1.28)) per token.
    assert stats["loss/policy"] == pytest.approx((-1 - 1 + math.exp(0.4) + 0.8) / 4)
    assert stats["loss/clip_frac_low"] == pytest.approx(1 / 4)


def test_learning_rate_schedule() -> None:
    opt = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine")
    assert [round(learning_rate(opt, s, 6), 3) for s in range(6)] == [
        0.5,
        1.0,
        1.0,
        0.854,
        0.5,
        0.146,
    ]
    lin = OptimConfig(lr=1.0, schedule="linear")
    assert learning_rate(lin, 0, 4) == 1.0 and learning_rate(lin, 3, 4) == 0.25
    assert learning_rate(OptimConfig(lr=0.1), 50, 4) == 0.1


# -- the example configs -----------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "countdown"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tinker_examples_validate_without_a_server(mode) -> None:
    """The whole config, the backend's own options and its refusals, the workflow and the data
    generator: everything `rllm-async train` checks before it contacts the service."""
    from rllm_async.imports import import_object
    from rllm_async.runner import build_workflow

    cfg = load_config(EXAMPLES / f"tinker_{mode}.yaml")
    assert cfg.mode == mode and cfg.backend.name == "tinker"
    options = check_config(cfg)
    assert options.base_model.startswith("Qwen/") and options.server_snapshots
    assert cfg.algorithm.loss.importance_sampling == "none"
    if mode == "async":
        assert cfg.coordinator.pipeline_depth == 1 and cfg.coordinator.weight_update == "pin"
    build_workflow(cfg)
    assert cfg.data.train is not None and cfg.data.train.generator is not None
    generate = import_object(cfg.data.train.generator, "data.train.generator")
    assert len(generate(**{**cfg.data.train.args, "n": 3})) == 3

    # Pointed at SkyRL's server (no snapshot samplers): async needs weight_update: latest.
    local = ["backend.server_snapshots=false", "backend.server_loss_reduction=sequence_mean"]
    if mode == "async":
        with pytest.raises(ConfigError, match="weight_update: latest"):
            check_config(load_config(EXAMPLES / "tinker_async.yaml", local))
        local.append("coordinator.weight_update=latest")
    check_config(load_config(EXAMPLES / f"tinker_{mode}.yaml", local))
