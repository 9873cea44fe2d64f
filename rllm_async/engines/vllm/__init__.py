"""The vLLM rollout engine: managed vLLM servers, a token-in/token-out policy client over them,
and the weight files they reload after each optimizer step.

The servers run under their own interpreter (`python scripts/vllm_env.py setup` builds
`.venv-vllm/`); everything here runs in the project's environment and needs `httpx`.
"""

from rllm_async.engines.vllm.client import PauseMode, VLLMPolicy, WeightSync
from rllm_async.engines.vllm.errors import VLLMServerError
from rllm_async.engines.vllm.server import VLLMServer
from rllm_async.engines.vllm.weights import check_weights, untied, write_weights

__all__ = [
    "PauseMode",
    "VLLMPolicy",
    "VLLMServer",
    "VLLMServerError",
    "WeightSync",
    "check_weights",
    "untied",
    "write_weights",
]
