"""The vLLM engine against real vLLM servers (CPU build), in the main interpreter.

The servers run under `.venv-vllm/bin/python` (`python scripts/vllm_env.py setup`). These tests
start several servers (~20 s each) and are left out of the default run:

    python -m pytest -m integration tests/integration/vllm
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rllm_async.engines.vllm.server import REPO_VENV_PYTHON, VLLMServer

sys.path.insert(0, str(Path(__file__).parent))  # served.py, by plain name

from served import make_server


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    mine = [item for item in items if here in item.path.parents]
    if "integration" not in config.getoption("markexpr", ""):
        reason = "real vLLM servers: run `python -m pytest -m integration tests/integration/vllm`"
    elif not REPO_VENV_PYTHON.is_file():
        reason = f"no {REPO_VENV_PYTHON}: run `python scripts/vllm_env.py setup` first"
    else:
        reason = ""
    for item in mine:
        item.add_marker(pytest.mark.integration)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Qwen3 (hidden 256, float32) with its tokenizer, built once."""
    from rllm_async.models.tiny_qwen import build_tiny_qwen

    return build_tiny_qwen(tmp_path_factory.mktemp("tiny-qwen"))


@pytest.fixture(scope="session")
def servers(
    tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VLLMServer]]:
    """Two servers of the tiny model, started together and shared by the whole session."""
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    started = [make_server(tiny_qwen, log_dir, i) for i in range(2)]

    async def start_all() -> None:
        await asyncio.gather(*(s.start() for s in started))

    try:
        asyncio.run(start_all())
        yield started
    finally:
        for server in started:
            server.stop()
