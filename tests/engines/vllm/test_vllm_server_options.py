"""The options that shape a started vLLM server (its command line and environment), checked with
a stand-in interpreter that prints what it was given and exits: no vLLM needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from rllm_async.engines.vllm import VLLMServer, VLLMServerError
from rllm_async.engines.vllm.engine import VLLMOptions
from tests.engines.vllm.tiny_engine import start_engine


def test_the_command_line_is_eager_unless_told_otherwise(tmp_path: Path) -> None:
    eager = VLLMServer(tmp_path, log_path=tmp_path / "log", port=1234, extra_args=["--seed", "1"])
    assert "--enforce-eager" in eager.command()
    assert eager.command()[-2:] == ["--seed", "1"]
    compiled = VLLMServer(tmp_path, log_path=tmp_path / "log", port=1234, enforce_eager=False)
    assert "--enforce-eager" not in compiled.command()
    assert "--enable-scale-out" in compiled.command()


def fake_interpreter(tmp_path: Path) -> Path:
    """An 'interpreter' that writes its arguments and environment to its output and exits 3."""
    script = tmp_path / "python"
    script.write_text('#!/bin/sh\necho "ARGS: $*"\nenv\nexit 3\n')
    script.chmod(0o755)
    return script


def test_the_engine_gives_each_server_its_device_and_environment(tmp_path: Path) -> None:
    opts = VLLMOptions(
        python=str(fake_interpreter(tmp_path)),
        devices=["3"],
        env={"RLLM_TEST_MARK": "on"},
        enforce_eager=False,
        weights_dir=str(tmp_path / "shm"),
    )
    with pytest.raises(VLLMServerError, match="exited with exit code 3"):
        start_engine(opts, tmp_path)
    log = (tmp_path / "run" / "vllm-0.log").read_text().splitlines()
    assert "CUDA_VISIBLE_DEVICES=3" in log and "RLLM_TEST_MARK=on" in log
    assert "VLLM_SERVER_DEV_MODE=1" in log
    [args] = [line for line in log if line.startswith("ARGS: ")]
    assert "vllm.entrypoints.openai.api_server" in args and "--enforce-eager" not in args
    assert not any((tmp_path / "shm").iterdir()), "a failed start deletes the weight files"


def test_devices_need_one_entry_per_started_server() -> None:
    assert VLLMOptions().devices == [] and VLLMOptions().enforce_eager is True
    VLLMOptions(servers=2, devices=["0", "1"])
    with pytest.raises(ValueError, match="one per started server"):
        VLLMOptions(servers=2, devices=["0"])
    with pytest.raises(ValueError, match="none with urls"):
        VLLMOptions(urls=["http://127.0.0.1:1"], devices=["0"])
