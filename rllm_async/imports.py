"""Resolve "package.module:attr" (or "package.module.attr") strings from config to objects."""

from __future__ import annotations

import importlib
from typing import Any

from rllm_async.config import ConfigError


def import_object(path: str, what: str) -> Any:
    """Import the object named by `path`; `what` names the config key in error messages."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{what}: '{path}' is not an import path like 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what}: cannot import module '{module_name}' ({e})") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{what}: module '{module_name}' has no attribute '{attr}'") from None
