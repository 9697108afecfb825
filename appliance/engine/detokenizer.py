"""Incremental detokenisation that never splits a multi-byte character.

Decoding token by token breaks byte-level BPE: a character may span tokens, and some tokenizers
change a token's text depending on its left neighbour. Like TGI and vLLM, decode a short window
(the previously emitted piece plus the new tokens) twice — with and without the new tokens — and emit the difference, holding
back text that ends in an incomplete character (U+FFFD) until the next token completes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    skip_special_tokens: bool = True
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text (may be empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            piece = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += piece
            return piece
        return ""

    def flush(self) -> str:
        """At the end of generation, emit whatever is still held back."""
        if self._read_offset == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        piece = full[len(prefix) :]
        self._read_offset = len(self._ids)
        self.text += piece
        return piece
