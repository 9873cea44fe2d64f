"""The local learner with `backend.rollout: vllm`: `rllm-async train` end to end on real vLLM
servers, the server killed mid-run, and multi-turn chat and the gateway over a vLLM policy."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from safetensors.torch import load_file

from rllm_async.backends.hf_tokenizer import load_tokenizer
from rllm_async.engines.vllm import VLLMPolicy, VLLMServer, write_weights
from rllm_async.gateway import Gateway
from rllm_async.protocols import SamplingParams
from rllm_async.rollout import RolloutContext

REPO = Path(__file__).resolve().parents[3]
RLLM = Path(sys.executable).parent / "rllm-async"


def write_config(
    tmp_path: Path,
    model: Path,
    mode: str,
    steps: int,
    workflow: dict[str, Any] | None = None,
    urls: list[str] | None = None,
    vllm_args: list[str] | None = None,
    max_concurrency: int | str = 256,
) -> Path:
    coordinator = {"pipeline_depth": 1, "max_staleness": 2, "weight_update": "latest"}
    config = {
        "name": f"vllm-{mode}",
        "mode": mode,
        "run_dir": str(tmp_path / "runs"),
        "backend": {
            "name": "local",
            "model_path": str(model),
            "max_seq_len": 256,
            "rollout": "vllm",
            "vllm": {
                "dtype": "float32",
                "weights_dir": str(tmp_path / "weights"),
                **({"urls": urls} if urls else {}),
                **({"extra_args": vllm_args} if vllm_args else {}),
            },
        },
        "workflow": workflow
        or {
            "cls": "rllm_async.workflows.SingleTurnWorkflow",
            "args": {"reward_fn": "tests.integration.vllm.tasks:reward"},
        },
        "data": {"train": {"generator": "tests.integration.vllm.tasks:generator"}},
        "rollout": {
            "group_size": 4,
            "max_tokens": 16,
            "timeout_s": 60,
            "retries": 1,
            "max_concurrency": max_concurrency,
        },
        "coordinator": coordinator if mode == "async" else {},
        "train": {"total_steps": steps, "groups_per_step": 4},
        "checkpoint": {"at_end": False},
        "logging": {"progress_bar": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(config: Path, stdout: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the test task module
    return subprocess.Popen(
        [str(RLLM), "train", str(config)],
        cwd=REPO,
        env=env,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
    )


def processes_in(run_dir: Path) -> list[int]:
    """Pids whose working directory is `run_dir`: the servers a run started there."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if Path(os.readlink(proc / "cwd")) == run_dir:
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rllm_async_train_runs_on_a_vllm_server(tiny_qwen: Path, tmp_path: Path, mode: str) -> None:
    """Async runs with `rollout.max_concurrency: auto`, which starts at the server's
    `--max-num-seqs` and, with rollouts that are all model call, stays there."""
    auto: dict[str, Any] = {}
    if mode == "async":
        auto = {"vllm_args": ["--max-num-seqs", "6"], "max_concurrency": "auto"}
    proc = train(write_config(tmp_path, tiny_qwen, mode, steps=3, **auto))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    run_dir = tmp_path / "runs" / f"vllm-{mode}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["time/sync_s"] > 0 for r in records)
    # The servers' pause of the previous step's sync, none before the first step's.
    assert records[0]["vllm/pause_s"] == 0 and all(r["vllm/pause_s"] > 0 for r in records[1:])
    assert all(r["vllm/restarts"] == 0 for r in records)
    # The first step trains on tokens sampled by the starting weights, served in float32: the
    # learner's logprobs equal the server's (importance weights 1, no sampler-learner KL).
    first = records[0]
    assert first["staleness/max"] == 0
    assert abs(first["loss/is_weight_mean"] - 1.0) < 1e-3 and first["loss/sampler_kl"] < 1e-4
    assert all(r["loss/num_tokens"] > 0 for r in records)
    if mode == "sync":
        assert all(r["staleness/max"] == 0 for r in records)
        assert "rollout/max_concurrency" not in first
    else:
        assert [r["rollout/max_concurrency"] for r in records] == [6, 6, 6]
        assert "'max_num_seqs': 6" in (run_dir / "vllm-0.log").read_text()  # what S came from
    assert (run_dir / "vllm-0.log").is_file()
    assert processes_in(run_dir.resolve()) == [], "the server was stopped with the run"
    assert not any((tmp_path / "weights").iterdir()), "the synced weights were deleted"


def test_a_multi_turn_workflow_trains_on_one_token_sequence_per_episode(
    servers: list[VLLMServer], tiny_qwen: Path, tmp_path: Path
) -> None:
    """`rllm-async train` with a two-turn env workflow on a running server (`vllm.urls`): each
    episode's two model calls form one training sequence (the second prompt extends the first
    call's exact tokens), whose sampled tokens carry the engine's logprobs, and the learner's
    logprobs of those sequences equal the server's (float32: importance weights 1)."""
    record = tmp_path / "episodes.jsonl"
    workflow = {
        "cls": "tests.integration.vllm.tasks.RecordingEnvWorkflow",
        "args": {
            "env": "tests.integration.vllm.tasks:TwoTurnEnv",
            "max_turns": 2,
            "record": str(record),
        },
    }
    url = servers[0].url
    config = write_config(tmp_path, tiny_qwen, "sync", steps=2, workflow=workflow, urls=[url])
    try:
        proc = train(config)
        out, _ = proc.communicate(timeout=240)
    finally:  # the server holds the run's last weights: give it the session's back
        state = load_file(str(tiny_qwen / "model.safetensors"))
        original = write_weights(state, tmp_path / "original", config=tiny_qwen / "config.json")
        tokenizer = load_tokenizer(tiny_qwen, setting="model")
        restore = VLLMPolicy([url], tokenizer, max_context_tokens=1024)
        asyncio.run(restore.update_weights(original, 0, mode="abort"))
    assert proc.returncode == 0, out
    episodes = [json.loads(line) for line in record.read_text().splitlines()]
    two_turn = [e for e in episodes if len(e["steps"]) == 2]
    assert len(two_turn) >= 16, len(two_turn)  # 2 steps x 4 groups x 4 rollouts, at least
    for episode in two_turn:
        (p1, c1, l1), (p2, c2, l2) = episode["steps"]
        assert p2[: len(p1) + len(c1)] == p1 + c1  # the second call extends the first's tokens
        [(tokens, mask, logprobs)] = episode["sequences"]
        assert tokens == p2 + c2
        sampled = [i for i, m in enumerate(mask) if m]
        assert sampled == [*range(len(p1), len(p1) + len(c1)), *range(len(p2), len(tokens))]
        assert [logprobs[i] for i in sampled] == l1 + l2
    run_dir = tmp_path / "runs" / "vllm-sync"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = records[0]
    assert abs(first["loss/is_weight_mean"] - 1.0) < 1e-3 and first["loss/sampler_kl"] < 1e-4


def comm(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def server_processes(run_dir: Path) -> tuple[int, int]:
    """The API server (its process group's leader) and the engine core of the run's server."""
    pids = processes_in(run_dir)
    [leader] = [pid for pid in pids if os.getpgid(pid) == pid]
    [core] = [pid for pid in pids if comm(pid).startswith("VLLM::EngineCor")]
    return leader, core


def wait_for(check: Any, proc: subprocess.Popen[str], output: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert proc.poll() is None and time.monotonic() < deadline, output.read_text()
        time.sleep(0.5)


def test_a_dead_server_is_restarted_once_and_a_second_death_stops_the_run(
    tiny_qwen: Path, tmp_path: Path
) -> None:
    """The API server killed alone (its engine core runs on, orphaned): the server is replaced,
    reloaded with the weights and version of the last sync, and training goes on (the rollouts
    that were in flight fail and are retried), with no process of the dead server left. Then
    the new server's engine core killed alone (its API server answers errors for a few seconds
    before it exits): a second death stops the run within seconds, naming the server, with no
    process left."""
    output = tmp_path / "output.txt"
    with output.open("w") as out:
        proc = train(write_config(tmp_path, tiny_qwen, "async", steps=1000), stdout=out)
    run_dir = (tmp_path / "runs" / "vllm-async").resolve()
    metrics = run_dir / "metrics.jsonl"

    def steps() -> int:
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    try:
        wait_for(lambda: steps() > 0, proc, output, 180)  # training has begun
        leader, core = server_processes(run_dir)
        os.kill(leader, signal.SIGKILL)
        wait_for(lambda: "is back at" in output.read_text(), proc, output, 120)
        before = steps()
        wait_for(lambda: steps() >= before + 2, proc, output, 120)  # training goes on
        text = output.read_text()
        assert "died; restarting it (restart 1 of at most 1)" in text, text
        new_leader, new_core = server_processes(run_dir)  # the dead server's core is gone
        assert new_leader != leader and new_core != core
        killed_at = time.monotonic()
        os.kill(new_core, signal.SIGKILL)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log = (run_dir / "vllm-0.log").read_text()[-4000:]
            pytest.fail(
                f"the run goes on 60 s after the second death:\n{output.read_text()}\n{log}"
            )
    finally:
        if proc.poll() is None:  # stop it as a user would, so that it stops its server
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    took = time.monotonic() - killed_at
    text = output.read_text()
    assert proc.returncode == 1, text
    # Through the rollouts (the breaker) or the next weight sync, whichever notices first.
    assert "rllm-async: the run stopped:" in text and "127.0.0.1" in text, text
    # No traceback of the run's own (the error quotes the server's log, which may hold vLLM's).
    assert not any(line.startswith("Traceback") for line in text.splitlines()), text
    assert took < 30, f"the run took {took:.0f}s to stop"
    assert processes_in(run_dir) == [], "no process of the server is left"


@pytest.fixture
def policy(servers: list[VLLMServer], tiny_qwen: Path) -> VLLMPolicy:
    tokenizer = load_tokenizer(tiny_qwen, setting="model")
    return VLLMPolicy([servers[0].url], tokenizer, max_context_tokens=1024)


def test_a_multi_turn_chat_on_vllm_extends_its_exact_tokens(policy: VLLMPolicy) -> None:
    import asyncio

    async def go() -> None:
        async with policy:
            ctx = RolloutContext(
                policy,
                sampling=SamplingParams(max_tokens=12, temperature=1.0),
                pin=False,
                deadline=float("inf"),
                task_id="t",
            )
            messages: list[dict[str, Any]] = [{"role": "user", "content": "what is 2 plus 2?"}]
            first = await ctx.chat_turn(messages)
            messages += [first.message, {"role": "user", "content": "and 3 plus 3?"}]
            second = await ctx.chat_turn(messages)
            assert second.extended
            before = first.step.prompt_ids + first.step.completion_ids
            assert second.step.prompt_ids[: len(before)] == before
            [sequence] = ctx.trajectory().sequences()
            assert sequence.tokens == second.step.prompt_ids + second.step.completion_ids
            sampled = [i for i, m in enumerate(sequence.loss_mask) if m]
            assert len(sampled) == len(first.step.completion_ids) + len(second.step.completion_ids)
            assert all(v == policy.version for s in (first, second) for v in s.step.versions)

    asyncio.run(go())


def test_the_gateway_serves_the_openai_client_from_vllm(policy: VLLMPolicy) -> None:
    import asyncio

    tool = {
        "type": "function",
        "function": {
            "name": "calc",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
        },
    }

    async def go() -> None:
        gateway = Gateway(policy, api_key="k", sampling=SamplingParams(max_tokens=16))
        await gateway.start()
        try:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="k")
            r = await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "compute 2+2"}],
                tools=[tool],  # type: ignore[list-item]
                logprobs=True,
                n=2,
                max_tokens=8,
            )
            assert len(r.choices) == 2 and r.usage is not None
            for choice in r.choices:
                assert choice.finish_reason in ("stop", "length", "tool_calls")
                assert choice.logprobs is not None and choice.logprobs.content
                assert r.usage.completion_tokens >= len(choice.logprobs.content)
        finally:
            await gateway.stop()
            await policy.close()

    asyncio.run(go())
