"""Incremental detokenization with stop strings, shared by the in-process engine and the api server."""

from __future__ import annotations

from typing import Any


class TextOutput:
    """The text of one request's output so far, grown a token at a time.

    A stop string ends the output: the text up to (not including) its first occurrence is kept,
    and nothing after it is ever returned, even when the match spans several tokens.

    Args:
        decoder: an incremental detokenizer (``Processor.incremental_decoder()``).
        stop: stop strings (may be empty).
    """

    def __init__(self, decoder: Any, stop: tuple[str, ...] = ()):
        self.decoder = decoder
        self.stop = stop
        self.text = ""
        self.stopped = False

    def append(self, token_id: int) -> str:
        """Add one generated (non-stop) token; returns the new text. Sets ``stopped`` on a stop string."""
        if self.stopped:
            raise RuntimeError("the output already ended on a stop string")
        text = self.text + self.decoder.step(token_id)
        hits = [h for h in (text.find(s, max(0, len(self.text) - len(s))) for s in self.stop) if h >= 0]
        if hits:
            end = min(hits)
            new_text = text[len(self.text):end] if end >= len(self.text) else ""
            self.text, self.stopped = text[:end], True
            return new_text
        new_text, self.text = text[len(self.text):], text
        return new_text
