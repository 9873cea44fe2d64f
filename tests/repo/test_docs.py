"""docs/config.md documents every key of the schema; docs/architecture.md shows the current
import graph."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from rllm_async.config import Config, DatasetConfig

ROOT = Path(__file__).resolve().parents[2]  # the repository


def keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = field.annotation
        sub = [
            a
            for a in getattr(ann, "__args__", (ann,))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if sub and sub[0] is DatasetConfig:
            out += keys(DatasetConfig, f"{path.rsplit('.', 1)[0]}.<split>.")
        elif sub and sub[0].model_config.get("extra") != "allow":
            out += keys(sub[0], f"{path}.")
        else:
            out.append(path)
    return out


def test_every_config_key_is_documented() -> None:
    doc = (ROOT / "docs" / "config.md").read_text()
    missing = [k for k in keys(Config) if f"`{k}`" not in doc]
    assert not missing, f"undocumented config keys: {missing}"


def test_the_architecture_page_shows_the_current_import_graph() -> None:
    graph = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert f"```text\n{graph}\n```" in doc, "run `python scripts/import_graph.py` and paste it"
