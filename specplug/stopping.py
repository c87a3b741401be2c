"""When a request ends: EOS, its token budget, a stop string or the model's positions."""
from __future__ import annotations

from typing import Sequence

from .types import SequenceState


def stop_strings(stop: str | Sequence[str]) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings: one string is one stop string, as in HF and vLLM (iterated,
    "def" would stop at any of d, e or f)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise (ValueError if s == "" else TypeError)(
                f"stop: each stop string must be a non-empty str, got {s!r}")
    return stops


class Stopper:
    """Appends a step's tokens to a sequence, cut where the request ends, and says why it ends."""

    def __init__(self, target, stop: str | Sequence[str] = ()):
        self.target, self.stop = target, stop_strings(stop)
        self.eos = target.eos_token_ids
        self.limit = target.max_positions or 1 << 62
        self.max_stop = max((len(s) for s in self.stop), default=0)

    def emit(self, seq: SequenceState, tokens: list[int], remaining: int) -> tuple[list[int], str]:
        """Append ``tokens`` to ``seq.ids``, cut at EOS (kept), the budget ``remaining`` or a stop string;
        return what stayed and why the request ends ("" if it goes on)."""
        emitted, reason = self._cut(tokens, remaining)
        seq.ids.extend(emitted)
        if self.stop and not reason:
            reason, cut = self._stop_hit(seq, len(emitted))
            if cut:
                del seq.ids[len(seq.ids) - cut:]
                emitted = emitted[: len(emitted) - cut]
        if not reason and len(seq.ids) >= self.limit:
            reason = "max_positions"
        return emitted, reason

    def _cut(self, tokens: list[int], remaining: int) -> tuple[list[int], str]:
        for i, t in enumerate(tokens[:remaining]):
            if t in self.eos:
                return tokens[: i + 1], "eos"
        if len(tokens) >= remaining:
            return tokens[:remaining], "length"
        return tokens, ""

    def _stop_hit(self, seq: SequenceState, n_new: int) -> tuple[str, int]:
        """Look for a stop string in the text ending with this step's tokens; return how many tokens to drop
        after it. Only a short tail is decoded (each token decodes to at least one character)."""
        out = seq.output_ids
        window = out[max(0, len(out) - n_new - self.max_stop):]
        text = self.target.decode(window)
        hits = [text.find(s) for s in self.stop if s in text]
        if not hits:
            return "", 0
        at = min(hits) + next(len(s) for s in self.stop if text.find(s) == min(hits))
        # keep the fewest tokens whose text still contains the stop string
        for keep in range(1, len(window) + 1):
            if len(self.target.decode(window[:keep])) >= at:
                return "stop", len(window) - keep
        return "stop", 0
