"""Resolve config strings to objects: "package.module:attr" (or "package.module.attr"), a module
beside the config or in the working directory, or "path/to/file.py:attr"."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from rllm_async.config import ConfigError, config_dirs


def import_object(path: str, what: str) -> Any:
    """Import the object named by `path`; `what` names the config key in error messages.

    Modules and relative `.py` files not found on `sys.path` are looked up in the working directory,
    then in the directories of the config files loaded (`rllm_async.config.config_dirs`)."""
    module_name, sep, attr = path.rpartition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(
            f"{what}: '{path}' is not an import path like 'package.module:Name' or 'file.py:Name'"
        )
    module = _load_file(module_name, what) if module_name.endswith(".py") else None
    if module is None:
        module = _import_module(module_name, what)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{what}: module '{module_name}' has no attribute '{attr}'") from None


def _search_dirs() -> list[Path]:
    return list(dict.fromkeys([Path.cwd(), *config_dirs]))


def _import_module(name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = name.split(".")[0]
        if e.name != top:  # a module the found one imports is missing: nothing to look for
            raise ConfigError(f"{what}: cannot import module '{name}' ({e})") from e
        for d in _search_dirs():
            if ((d / top).is_dir() or (d / f"{top}.py").is_file()) and str(d) not in sys.path:
                sys.path.append(str(d))
                return _import_module(name, what)
        where = ", ".join(str(d) for d in _search_dirs())
        raise ConfigError(
            f"{what}: cannot import module '{name}': it is not installed and not in {where}; "
            "put it beside the config or give its file as 'path/to/file.py:function'"
        ) from e
    except ImportError as e:
        raise ConfigError(f"{what}: cannot import module '{name}' ({e})") from e


def _load_file(name: str, what: str) -> ModuleType:
    """The module of a `.py` file: absolute, or relative to the working directory or a config's."""
    given = Path(name).expanduser()
    candidates = [given] if given.is_absolute() else [d / given for d in _search_dirs()]
    file = next((c.resolve() for c in candidates if c.is_file()), None)
    if file is None:
        raise ConfigError(
            f"{what}: file '{name}' not found (looked for {', '.join(map(str, candidates))}); "
            "give a path relative to the working directory or to the config file"
        )
    key = f"rllm_async_user_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if key in sys.modules:  # one module per file, however often a config names it
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[key]
        raise ConfigError(f"{what}: importing {file} failed: {type(e).__name__}: {e}") from e
    return module
