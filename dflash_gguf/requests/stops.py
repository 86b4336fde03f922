"""Stop strings over a request's tokens: the consumer that ends a request once its text holds one.

Stop tokens (a chat template's end-of-turn, ``StopOnTokens``) are the decoder's own: :mod:`dflash_gguf.requests.stopping`.
"""
from __future__ import annotations

from typing import Callable, Sequence


class StopStrings:
    """A request's consumer (see :class:`dflash_gguf.decoding.sequence.Request`): keeps tokens until the text
    holds one of ``stops``, then ends the request after the token that completed it. ``silent``: tokens
    that add no text (end-of-generation tokens: llama_cpp ends on one without its text, which for some
    vocabularies is an ordinary byte)."""

    def __init__(self, piece: Callable[[int], bytes], stops: Sequence[str], silent: frozenset = frozenset()):
        self.piece, self.stops, self.silent = piece, [s for s in stops if s], silent
        self.longest = max((len(s) for s in self.stops), default=0)
        self.raw = b""
        self.seen = 0                  # characters of text already searched (less a stop string's length)
        self.cut: int | None = None    # character offset of the first stop string found

    def text(self) -> str:
        """The completion's text: bytes that are not UTF-8 left out, as llama_cpp does."""
        text = self.raw.decode("utf-8", "ignore")
        return text if self.cut is None else text[:self.cut]

    def __call__(self, tokens: list[int]) -> int | None:
        for j, tok in enumerate(tokens):
            if tok in self.silent:
                continue
            self.raw += self.piece(tok)
            if self.stops:
                text = self.raw.decode("utf-8", "ignore")
                start = max(0, self.seen - self.longest)
                hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
                self.seen = len(text)
                if hits:
                    self.cut = min(hits)
                    return j + 1
        return None


def stop_list(stop: str | Sequence[str] | None) -> list[str]:
    """A request's ``stop`` field (a string, a list of them, or None) as a list."""
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
