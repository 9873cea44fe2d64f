"""`response_format`: enforced while sampling where the policy's engine constrains decoding (the
vLLM engine's structured outputs), and every reply checked against it, the gateway saying what it
found (never repairing it)."""

from __future__ import annotations

import json

import jsonschema

from rllm_async.gateway.protocol import ResponseFormat


def constraint(fmt: ResponseFormat | None) -> str | None:
    """`fmt` as a decoding constraint (`SamplingParams.structured`), None for plain text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        return json.dumps({"json_object": True})
    return json.dumps({"json": fmt.json_schema.schema_})


def format_error(fmt: ResponseFormat, content: str | None) -> str | None:
    """Why `content` does not follow `fmt`, or None when it does."""
    if fmt.type == "text":
        return None
    try:
        value = json.loads(content or "")
    except (ValueError, RecursionError) as e:
        return f"not JSON ({e})"
    if fmt.json_schema is None:  # json_object
        return None if isinstance(value, dict) else "not a JSON object"
    if fmt.json_schema.schema_ is None:
        return None
    try:
        jsonschema.validate(value, fmt.json_schema.schema_)
    except jsonschema.ValidationError as e:
        return f"does not match the schema {fmt.json_schema.name!r}: {e.message}"
    except jsonschema.SchemaError as e:
        return f"the schema {fmt.json_schema.name!r} is not a valid JSON schema: {e.message}"
    return None
