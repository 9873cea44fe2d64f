"""Failures of real vLLM servers: start-up, a bad reload, a crash, and stopping."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from served import CONTEXT, engine_core, make_server

from rllm_async.backends.hf_tokenizer import load_tokenizer
from rllm_async.engines.vllm import VLLMPolicy, VLLMServerError, check_weights, write_weights
from rllm_async.protocols import SamplingParams


def group_members(pgid: int) -> list[int]:
    """Ids of the live processes in process group `pgid`, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_a_start_up_timeout_names_the_log_and_leaves_no_process(
    tiny_qwen: Path, tmp_path: Path
) -> None:
    server = make_server(tiny_qwen, tmp_path, 0, startup_timeout_s=2.0)
    with pytest.raises(VLLMServerError, match=rf"within 2s.*{tmp_path / 'vllm-0.log'}"):
        asyncio.run(server.start())
    assert server.pid is not None and not server.alive
    assert group_members(server.pid) == []


def test_a_missing_interpreter_says_how_to_build_it(tiny_qwen: Path, tmp_path: Path) -> None:
    server = make_server(tiny_qwen, tmp_path, 0, python=tmp_path / "no-python")
    with pytest.raises(VLLMServerError, match=re.escape("scripts/vllm_env.py setup")):
        asyncio.run(server.start())


def test_unreadable_weights_are_refused_before_any_server_sees_them(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        check_weights(tmp_path)
    with pytest.raises(ValueError, match=re.escape("no *.safetensors")):
        check_weights(tmp_path / "missing")


def test_a_crash_fails_requests_in_flight_and_later_ones_fast(
    tiny_qwen: Path, tmp_path: Path
) -> None:
    server = make_server(tiny_qwen, tmp_path, 0)
    tok = load_tokenizer(tiny_qwen, setting="model")
    params = SamplingParams(max_tokens=900)

    async def go() -> None:
        await server.start()
        assert server.alive and await server.healthy()
        pgid = server.pid
        assert pgid is not None
        async with VLLMPolicy([server.url], tok, max_context_tokens=CONTEXT) as policy:
            running = asyncio.create_task(policy.generate([5, 6, 7], params))
            await asyncio.sleep(1.0)
            os.killpg(pgid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(VLLMServerError, match=rf"connection to .*{server.url} broke"):
                await running
            with pytest.raises(
                VLLMServerError, match=rf"(cannot connect|connection) .*{server.url}"
            ):
                await policy.generate([5, 6, 7], params)
            assert time.monotonic() - start < 5
        assert not await server.healthy()

    try:
        asyncio.run(go())
    finally:
        server.stop()


def test_a_sync_in_flight_when_the_engine_dies_fails_without_waiting_for_its_timeout(
    tiny_qwen: Path, tmp_path: Path
) -> None:
    """vLLM never answers a control call that was in flight when its engine core died (the API
    server stops listening and waits for it): the sync fails once `/health` says so, not after
    read_timeout_s. The core is stopped first, so that `/pause` is surely in flight."""
    server = make_server(tiny_qwen, tmp_path, 0)
    tok = load_tokenizer(tiny_qwen, setting="model")
    weights = write_weights(
        load_file(str(tiny_qwen / "model.safetensors")),
        tmp_path / "w",
        config=tiny_qwen / "config.json",
    )

    async def go() -> None:
        await server.start()
        core = engine_core(server)
        policy = VLLMPolicy([server.url], tok, max_context_tokens=CONTEXT, read_timeout_s=600)
        async with policy:
            os.kill(core, signal.SIGSTOP)
            sync = asyncio.create_task(policy.update_weights(weights, 1, mode="wait"))
            await asyncio.sleep(3.0)  # /pause is sent, and unanswered while the core is stopped
            assert not sync.done()
            os.kill(core, signal.SIGKILL)
            with pytest.raises(VLLMServerError, match=r"/health .*while /pause was in flight"):
                await asyncio.wait_for(sync, 120)  # only catches a hang
            assert policy.version == 0

    try:
        asyncio.run(go())
    finally:
        server.stop()


def test_a_failed_reload_is_reported_and_stop_leaves_no_process(
    tiny_qwen: Path, tmp_path: Path
) -> None:
    server = make_server(tiny_qwen, tmp_path, 0)
    tok = load_tokenizer(tiny_qwen, setting="model")
    state = load_file(str(tiny_qwen / "model.safetensors"))
    wrong_shape = write_weights({**state, "lm_head.weight": torch.zeros(3, 3)}, tmp_path / "bad")

    async def go() -> None:
        await server.start()
        policy = VLLMPolicy([server.url], tok, max_context_tokens=CONTEXT, sync_timeout_s=10)
        async with policy:
            start = time.monotonic()
            with pytest.raises(VLLMServerError, match=rf"version 1 failed.*{server.url}"):
                await policy.update_weights(wrong_shape, 1, mode="wait")
            assert time.monotonic() - start < 30  # bounded by sync_timeout_s, never a hang
            assert policy.version == 0

    try:
        asyncio.run(go())
        pgid = server.pid
        assert pgid is not None and len(group_members(pgid)) > 1  # the engine runs in a child
    finally:
        server.stop()
    assert not server.alive
    assert group_members(pgid) == []
