"""Create (or reuse) `.venv-verl/`: verl 0.9.1, a pinned torch and this repo, kept apart from the
main interpreter because verl pins its own transformers, tensordict and Ray.

    python scripts/verl_env.py setup                 # idempotent; prints what it did and how long
    python scripts/verl_env.py setup --fresh         # delete .venv-verl/, then build it anew (CI)
    .venv-verl/bin/python -m pytest tests/integration/verl       # the verl backend's tests

`--torch` picks the torch requirement (default `torch==2.13.0`, the CPU build where one is on the
package index's find-links; elsewhere pass e.g. a CUDA build for GPU machines).
"""

from __future__ import annotations

from side_venv import ROOT, main

VENV = ROOT / ".venv-verl"
VERL = "verl[verl-core]==0.9.1"
PROBE = (
    "import importlib.metadata as m, rllm_async.backends.verl.cpu; "
    "assert m.version('verl') == '0.9.1'; import ray, tensordict"
)


def steps(torch_spec: str) -> list[list[str]]:
    """verl, the torch requirement and this repository with its test tools, in one resolve."""
    return [["install", VERL, torch_spec, "-e", f"{ROOT}[dev]"]]


if __name__ == "__main__":
    main(VENV, "verl 0.9.1", PROBE, steps, __doc__.splitlines()[0])
