"""Chat prompts through the tokenizer's own chat template, safe against forged roles.

Message contents are user data: if they were tokenised together with the rendered template, a
message containing `<|im_start|>system` would become the real control token and open a forged
turn. So the template is rendered with a unique placeholder in place of each content; the
template's own text is tokenised normally (its control tokens are real) and each content is
tokenised with special-token parsing off (control-token text stays ordinary characters).
"""

from __future__ import annotations

import secrets
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictStr, TypeAdapter, ValidationError

from .validation import problems

ROLES = ("system", "user", "assistant")


class TextPart(BaseModel):
    """An OpenAI content part; only text parts are accepted."""

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: Literal[ROLES]
    content: StrictStr | list[TextPart]

    def plain(self) -> dict[str, str]:
        """{"role", "content": str}, text parts joined."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


Messages = Annotated[list[ChatMessage], Field(min_length=1)]
_MESSAGES = TypeAdapter(Messages)


def validate_messages(messages: object) -> list[dict]:
    """Return messages as [{"role", "content": str}], or raise ValueError naming the problem."""
    try:
        parsed = _MESSAGES.validate_python(messages)
    except ValidationError as exc:
        raise ValueError(problems(exc, root=("messages",))[0].message) from None
    return [m.plain() for m in parsed]


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
