"""Weights on disk for a vLLM server to reload: Hugging Face names, safetensors, never half-written."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

EMBEDDINGS = "model.embed_tokens.weight"
OUTPUT_LAYER = "lm_head.weight"


def untied(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with an explicit output layer: vLLM's reload leaves a tied one at its old values."""
    out = dict(state)
    if OUTPUT_LAYER not in out:
        if EMBEDDINGS not in out:
            raise ValueError(f"the weights have neither {OUTPUT_LAYER} nor {EMBEDDINGS}")
        out[OUTPUT_LAYER] = out[EMBEDDINGS]
    return out


def write_weights(
    state: Mapping[str, torch.Tensor],
    out_dir: Path,
    *,
    config: Mapping[str, Any] | Path | None = None,
) -> Path:
    """Write `state` (Hugging Face names) to `out_dir/model.safetensors`, untied, atomically.

    `config` (a checkpoint's config.json, or its contents) is written alongside with
    `tie_word_embeddings: false`, so that the directory is also a loadable checkpoint. The files go
    to a temporary sibling that is renamed into place: a reader sees the old directory or the new
    one, never a partial one. An existing `out_dir` is replaced.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Each tensor its own contiguous CPU storage: safetensors refuses shared or strided ones.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in untied(state).items()}
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if config is not None:
            raw = json.loads(config.read_text()) if isinstance(config, Path) else dict(config)
            raw["tie_word_embeddings"] = False
            (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        _replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def check_weights(weights_dir: Path) -> None:
    """Refuse a directory without safetensors files, or with one whose header does not parse
    (a truncated or foreign file), before a server tries to load it."""
    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{weights_dir} holds no *.safetensors weights to reload")
    for file in files:
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            try:
                if not 0 < size <= file.stat().st_size - 8:
                    raise ValueError(f"a header of {size} bytes")
                header = json.loads(f.read(size))
                if not isinstance(header, dict):
                    raise ValueError("a header that is not a JSON object")
            except ValueError as e:
                raise ValueError(f"{file} is not a readable safetensors file ({e})") from None


def _replace(new: Path, target: Path) -> None:
    """Rename `new` to `target`, moving an existing `target` aside first and deleting it after."""
    if not target.exists():
        os.rename(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.rename(target, old / target.name)
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)
