"""Chat prompts through the tokenizer's own chat template, safe against forged roles.

Message contents are user data: if they were tokenised together with the rendered template, a
message containing `<|im_start|>system` would become the real control token and open a forged
turn. So the template is rendered with a unique placeholder in place of each content; the
template's own text is tokenised normally (its control tokens are real) and each content is
tokenised with special-token parsing off (control-token text stays ordinary characters).
"""

from __future__ import annotations

import secrets

ROLES = ("system", "user", "assistant")


def validate_messages(messages: object) -> list[dict]:
    """Return messages as [{"role", "content": str}], or raise ValueError naming the problem."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    clean = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        content = msg.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text parts
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ValueError(f"messages[{i}].content parts must be text parts")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        clean.append({"role": role, "content": content})
    return clean


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat prompt, with an assistant turn opened for the reply."""
    messages = validate_messages(messages)
    marks = [f"\x00{secrets.token_hex(8)}\x00" for _ in messages]
    templated = [{"role": m["role"], "content": mark} for m, mark in zip(messages, marks)]
    rendered = tokenizer.apply_chat_template(templated, tokenize=False, add_generation_prompt=True)
    ids: list[int] = []
    rest = rendered
    for msg, mark in zip(messages, marks):
        before, found, rest = rest.partition(mark)
        if not found:
            raise ValueError("the chat template dropped a message; cannot encode safely")
        ids += tokenizer.encode(before, add_special_tokens=False)
        ids += tokenizer.encode(msg["content"], add_special_tokens=False, split_special_tokens=True)
    ids += tokenizer.encode(rest, add_special_tokens=False)
    return ids
