"""The one error the vLLM engine raises for a server that fails, refuses or cannot be reached."""

from __future__ import annotations

from rllm_async.protocols import BackendError


class VLLMServerError(BackendError):
    """A vLLM server failed to start, refused a request, or could not be reached."""
