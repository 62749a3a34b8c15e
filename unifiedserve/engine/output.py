"""Incremental detokenization with stop strings, shared by the in-process engine and the api server."""

from __future__ import annotations

from typing import Any


class TextOutput:
    """The text of one request's output so far, grown a token at a time.

    A stop string ends the output: the text up to (not including, unless ``include_stop``) its first
    occurrence is kept, and nothing after it is ever returned, even when the match spans several tokens.
    What :meth:`append` returns never includes text a later token could turn into a stop string: a tail
    of the text that begins a stop string is held back until it cannot, or until :meth:`finish`. So the
    pieces returned add up to :attr:`text`, streamed or not (vLLM holds back the same way, a fixed
    ``max(len(stop)) - 1`` characters; here only what does begin a stop string waits).

    Args:
        decoder: an incremental detokenizer (``Processor.incremental_decoder()``).
        stop: stop strings (may be empty).
        include_stop: keep the matched stop string at the end of the text (vLLM's
            ``include_stop_str_in_output``); nothing is then held back, since what is shown stays shown.
    """

    def __init__(self, decoder: Any, stop: tuple[str, ...] = (), include_stop: bool = False, min_tokens: int = 0):
        self.decoder = decoder
        self.stop = stop
        self.include_stop = include_stop
        self.min_tokens = min_tokens  # stop strings count in tokens from this index on (vLLM's rule)
        self.text = ""
        self.stopped = False
        self._shown = 0  # characters of ``text`` returned so far

    def append(self, token_id: int, check_stop: bool = True) -> str:
        """Add one generated token; returns the text it makes safe to show. Sets ``stopped`` on a stop string.

        ``check_stop``: look for stop strings ending in this token's text (vLLM looks only once a request has
        more than ``min_tokens`` output tokens); a stop string may still begin in earlier text.
        """
        if self.stopped:
            raise RuntimeError("the output already ended on a stop string")
        old = len(self.text)
        self.text += self.decoder.step(token_id)
        if check_stop and len(self.text) > old:
            # a new match ends in the new text: it starts at most len(s) - 1 characters before it
            hits = [(h, s) for h, s in ((self.text.find(s, max(0, old - len(s) + 1)), s) for s in self.stop) if h >= 0]
            if hits:
                start, s = min(hits)
                self.text, self.stopped = self.text[:start + (len(s) if self.include_stop else 0)], True
                return self._show(len(self.text))
        return self._show(len(self.text) - self._stop_prefix())

    def add(self, token_id: int, index: int, is_stop_token: bool = False) -> str:
        """A request's output token ``index`` (a stop token: ``is_stop_token``); returns the new text to show.

        A stop token is no text unless ``include_stop``; stop strings count only in tokens past ``min_tokens``.
        """
        if is_stop_token and not self.include_stop:
            return ""
        return self.append(token_id, check_stop=index >= self.min_tokens)

    def finish(self) -> str:
        """The output ended: the tail held back as a possible stop string's start (nothing once ``stopped``).

        Bytes the decoder holds back as an incomplete UTF-8 character stay out of the text, as in vLLM: they
        would decode to U+FFFD.
        """
        return self._show(len(self.text))

    def _show(self, upto: int) -> str:
        new, self._shown = self.text[self._shown:upto], max(self._shown, upto)
        return new

    def _stop_prefix(self) -> int:
        """The length of the longest tail of the text not yet shown that is a proper prefix of a stop string."""
        if self.include_stop or not self.stop or len(self.text) == self._shown:
            return 0
        text, last, room, best = self.text, self.text[-1], len(self.text) - self._shown, 0
        for s in self.stop:
            # candidate tails end with the text's last character: s[:i + 1] for each i where s[i] == last
            i = s.rfind(last, 0, min(len(s) - 1, room))
            while i >= best:
                if text.endswith(s[:i + 1]):
                    best = i + 1
                    break
                i = s.rfind(last, 0, i)
        return best


def text_output(processor: Any, params: Any) -> TextOutput:
    """A request's :class:`TextOutput`: its ``SamplingParams``' stop strings, ``include_stop_str_in_output``,
    ``min_tokens`` and ``skip_special_tokens``, over ``processor``'s (a ``Processor``) incremental decoder."""
    return TextOutput(processor.incremental_decoder(params.skip_special_tokens), params.stop,
                      params.include_stop_str_in_output, params.min_tokens)
