"""`POST /v1/completions`: the handler, its response body and its streamed chunks."""

from __future__ import annotations

import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rllm_async.gateway.api import API
from rllm_async.gateway.chat_completions import usage
from rllm_async.gateway.errors import APIError
from rllm_async.gateway.protocol import CompletionRequest
from rllm_async.gateway.sse import data_stream
from rllm_async.protocols import Completion
from rllm_async.rollout.chat import cut_at_stop


async def completions(api: API, request: Request) -> Response:
    """`POST /v1/completions`: a text or token-id prompt, one `generate` per choice."""
    session = api.session(request)
    req = await api.body(request, CompletionRequest)
    api.check_model(req.model)
    ctx = api.context(session)
    tok = ctx.policy.tokenizer
    if isinstance(req.prompt, str):
        prompt = tok.encode(req.prompt)
    else:
        vocab = getattr(tok, "vocab_size", None)
        if not isinstance(vocab, int):
            raise APIError(
                400,
                "token-id prompts are not supported by this policy's tokenizer",
                param="prompt",
            )
        if any(not 0 <= t < vocab for t in req.prompt):
            raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        prompt = list(req.prompt)
    if not prompt:
        raise APIError(400, "prompt: encodes to no tokens", param="prompt")
    overrides = [api.sampling(req, session, i) for i in range(req.n)]
    outs = await api.run(request, session, lambda: [ctx.generate(prompt, **o) for o in overrides])
    body = _body(req, prompt, outs, api.gw.model, tok)
    if req.stream:
        return data_stream(_chunks(body))
    return JSONResponse(body)


def _body(
    req: CompletionRequest, prompt: list[int], outs: list[Completion], model: str, tok: Any
) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outs):
        text = cut_at_stop(tok.decode(out.ids), req.stops)
        choice: dict[str, Any] = {
            "index": i,
            "text": text,
            "logprobs": None,
            "finish_reason": out.finish_reason,
        }
        if req.logprobs is not None:
            tokens = [tok.decode([t]) for t in out.ids]
            offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": out.logprobs,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        choices.append(choice)
    return {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(len(prompt), sum(len(o.ids) for o in outs)),
    }


def _chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
    head = {k: body[k] for k in ("id", "object", "created", "model")}
    return [{**head, "choices": [choice]} for choice in body["choices"]]
