"""Text of a growing list of tokens, piece by piece: what ``stream`` and the CLI show as tokens arrive."""
from __future__ import annotations

from typing import Callable, Sequence

# how many tokens before the unread ones are decoded with them, so a tokenizer that drops or merges a
# leading space at the start of a decode sees its real context
CONTEXT = 5
# a UTF-8 character has at most 4 bytes: text still ending in U+FFFD after this many more tokens is shown
# (invalid bytes, not a character on its way)
MAX_HELD = 4


class IncrementalDetokenizer:
    """Decodes only the newest tokens (and a few before them) on each ``push``: O(new) per step, not O(text).

    A trailing partial UTF-8 character (decoded as U+FFFD) is held back until its last byte arrives (or
    MAX_HELD tokens have passed);
    ``flush`` gives whatever is left once no more tokens come, so the pieces add up to ``decode(all tokens)``."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] is the context already shown
        self.read = 0
        self.shown = 0  # characters shown so far

    def push(self, tokens: Sequence[int]) -> str:
        """The text the new ``tokens`` complete ("" while a character is still incomplete)."""
        self.ids.extend(int(t) for t in tokens)
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        waiting = text.endswith("\ufffd") and len(self.ids) - self.read < MAX_HELD
        if len(text) <= len(before) or waiting:
            return ""
        piece = text[len(before):]
        self.prefix, self.read = max(self.prefix, len(self.ids) - CONTEXT), len(self.ids)
        self.shown += len(piece)
        return piece

    def flush(self) -> str:
        """The rest of the text (a held-back partial character, as ``decode`` renders it): one whole decode."""
        text = self.decode(self.ids)
        piece = text[self.shown:]
        self.shown = len(text)
        return piece
