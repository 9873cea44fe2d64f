"""Print the installed versions of the packages this project's results depend on, one `name==version`
a line (the packages an environment lacks are left out), for CI logs and docs/install.md.

    python scripts/versions.py                 # this interpreter's environment
    .venv-skyrl/bin/python scripts/versions.py # the Tinker server's
    .venv-verl/bin/python scripts/versions.py  # verl's

Standard library only.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

KEY_PACKAGES = [
    "rllm-async",
    "torch",
    "numpy",
    "transformers",
    "tokenizers",
    "pydantic",
    "starlette",
    "uvicorn",
    "httpx",
    "openai",
    "tinker",
    "wandb",
    "omegaconf",
    "matplotlib",
    "pytest",
    "hypothesis",
    "schemathesis",
    "ruff",
    "mypy",
    # The Tinker server's venv.
    "skyrl",
    "jax",
    "flax",
    # verl's venv.
    "verl",
    "ray",
    "tensordict",
]


def versions() -> dict[str, str]:
    """The installed version of each key package, in KEY_PACKAGES' order."""
    found = {}
    for name in KEY_PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def main() -> None:
    print(f"# {sys.prefix}: Python {platform.python_version()} on {platform.machine()}")
    for name, version in versions().items():
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
