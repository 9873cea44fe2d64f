"""The verl backend's tests run only where verl is importable: `python scripts/verl_env.py setup`
makes `.venv-verl/`, and `.venv-verl/bin/python -m pytest tests/integration/verl` runs them."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import pytest

REASON = (
    "verl is not importable in this interpreter: run `python scripts/verl_env.py setup`, then "
    "`.venv-verl/bin/python -m pytest tests/integration/verl`"
)

sys.path.insert(0, str(Path(__file__).parent))  # tiny_checkpoint and rewards, by plain name


def _verl_installed() -> bool:
    # Not find_spec("verl"): with tests/ on sys.path that finds this very folder.
    try:
        importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not _verl_installed():

    class _Skipped(pytest.Module):
        def collect(self) -> Any:
            pytest.skip(REASON)

    def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> pytest.Module:
        return _Skipped.from_parent(parent, path=module_path)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~25k-parameter random Llama with a character tokenizer, written once per session."""
    from tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))
