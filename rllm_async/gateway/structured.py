"""`response_format` checks: the policy's samplers cannot constrain decoding to JSON today, so the
gateway checks each reply against the requested format and says what it found (never repairs it)."""

from __future__ import annotations

import json

import jsonschema

from rllm_async.gateway.protocol import ResponseFormat


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
