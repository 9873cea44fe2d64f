"""Start SkyRL's Tinker API server (and its engine) without `uv run`, on Python 3.11.

Two in-memory workarounds, no installed file is changed:
- SkyRL 0.3.0's API server starts its engine with a command built from its parent's command line
  (`uv run <flags> --extra tinker --extra jax -m skyrl.tinker.engine ...`) and fails when the parent
  is not `uv run`. We replace that builder with one that runs `launch.py engine ...` with this
  same interpreter.
- SkyRL declares Python >= 3.11 but its pydantic models use `typing.TypedDict`, which pydantic only
  accepts from Python 3.12 on. On 3.11 we point `typing.TypedDict` at `typing_extensions.TypedDict`
  before SkyRL is imported, in both processes.

    .venv-skyrl/bin/python scripts/tinker_server/launch.py api --base-model DIR --port 8000 ...
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any


def _py311_typeddict() -> None:
    if sys.version_info < (3, 12):
        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]


def engine_command(_parent_cmd: list[str], engine_config: Any) -> list[str]:
    """The engine command: this interpreter running `launch.py engine`, not `uv run`."""
    from skyrl.tinker.config import config_to_argv

    return [sys.executable, str(Path(__file__).resolve()), "engine", *config_to_argv(engine_config)]


def run_api(argv: list[str]) -> None:
    import uvicorn
    from skyrl.tinker import api
    from skyrl.tinker.config import EngineConfig, add_model
    from skyrl.utils.log import get_uvicorn_log_config

    parser = argparse.ArgumentParser(description="SkyRL Tinker API server")
    add_model(parser, EngineConfig)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    fields = {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields}
    api.app.state.engine_config = EngineConfig.model_validate(fields)
    api._build_uv_run_cmd_engine = engine_command
    uvicorn.run(api.app, host=args.host, port=args.port, log_config=get_uvicorn_log_config())


def run_engine(argv: list[str]) -> None:
    from skyrl.tinker import engine

    sys.argv = [engine.__file__, *argv]
    engine.main()


def main() -> None:
    _py311_typeddict()
    if len(sys.argv) < 2 or sys.argv[1] not in ("api", "engine"):
        sys.exit(f"usage: {sys.argv[0]} api|engine [options]")
    (run_api if sys.argv[1] == "api" else run_engine)(sys.argv[2:])


if __name__ == "__main__":
    main()
