"""Schemathesis hooks for tests/test_security_input.py (loaded through SCHEMATHESIS_HOOKS):
a check that every error the server answers has OpenAI's shape."""

import json

import schemathesis

ERROR_KEYS = {"message", "type", "param", "code"}


@schemathesis.check
def openai_error_shape(ctx, response, case):
    """4xx/5xx bodies are {"error": {"message", "type", "param", "code"}} with a non-empty message."""
    if response.status_code < 400:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"HTTP {response.status_code} with a body that is not JSON: {response.content[:200]!r}")
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_KEYS:
        raise AssertionError(f"HTTP {response.status_code} error body is not in OpenAI's shape: {body!r}"[:500])
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        raise AssertionError(f"HTTP {response.status_code} error without a message or type: {body!r}"[:500])
    return None
