"""The OpenAI-compatible gateway over any backend's policy, with per-rollout recording sessions."""

from rllm_async.gateway.errors import APIError
from rllm_async.gateway.server import Gateway
from rllm_async.gateway.sessions import Session, SessionStore

__all__ = ["APIError", "Gateway", "Session", "SessionStore"]
