"""The one error the vLLM engine raises for a server that fails, refuses or cannot be reached."""

from __future__ import annotations


class VLLMServerError(RuntimeError):
    """A vLLM server failed to start, refused a request, or could not be reached."""
