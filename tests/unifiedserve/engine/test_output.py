"""``TextOutput``: stop strings over token pieces; what is streamed adds up to the text, whatever the pieces."""

from __future__ import annotations

import random

import pytest

from unifiedserve.engine.output import TextOutput


class Pieces:
    """An incremental decoder that returns given text pieces (one per token id: the id indexes ``pieces``)."""

    def __init__(self, pieces, tail=""):
        self.pieces, self.tail = pieces, tail

    def step(self, token_id):
        return self.pieces[token_id]

    def flush(self):
        tail, self.tail = self.tail, ""
        return tail


def _run(pieces, stop, include_stop=False, check_from=0, tail=""):
    """Feed every piece (stop strings checked from token ``check_from``); returns (streamed pieces, output)."""
    out = TextOutput(Pieces(pieces, tail), tuple(stop), include_stop)
    shown = []
    for i in range(len(pieces)):
        shown.append(out.append(i, check_stop=i >= check_from))
        if out.stopped:
            break
    shown.append(out.finish())
    return shown, out


def test_a_stop_string_across_two_tokens_is_never_streamed():
    shown, out = _run(["xa", "b", "c"], ["ab"])
    assert out.stopped and out.text == "x"
    assert shown == ["x", "", ""]  # the "a" waited: it began the stop string


def test_a_held_back_tail_is_released_when_no_stop_string_follows():
    shown, out = _run(["xa", "c"], ["ab"])
    assert shown == ["x", "ac", ""] and out.text == "xac" and not out.stopped
    shown, out = _run(["xa"], ["ab"], tail="\ufffd")  # the end releases it; an incomplete character stays out
    assert shown == ["x", "a"] and out.text == "xa"


def test_the_longest_tail_that_begins_a_stop_string_waits():
    shown, out = _run(["zab", "ab", "abc!"], ["ababc"])
    assert out.text == "zab" and out.stopped
    assert "".join(shown) == "zab" and shown[0] == "z"


def test_include_stop_keeps_the_stop_string_and_cuts_what_follows():
    shown, out = _run(["xa", "bc", "d"], ["ab"], include_stop=True)
    assert out.text == "xab" and shown == ["xa", "b", ""]


def test_stop_strings_before_min_tokens_do_not_count_but_one_ending_after_does():
    shown, out = _run(["ab", "x", "ab"], ["ab"], check_from=1)  # the first "ab" is in token 0: not checked
    assert out.text == "abx" and out.stopped and "".join(shown) == "abx"
    shown, out = _run(["a", "b"], ["ab"], check_from=1)  # begins in an unchecked token, ends in a checked one
    assert out.text == "" and out.stopped and shown == ["", "", ""]


def test_appending_after_a_stop_string_is_an_error():
    _, out = _run(["ab"], ["b"])
    with pytest.raises(RuntimeError, match="already ended"):
        out.append(0)


@pytest.mark.parametrize("seed", range(40))
def test_streamed_pieces_add_up_to_the_text_and_it_ends_where_a_stop_string_first_ends(seed):
    """Random pieces over a small alphabet and random stop strings. The reference cuts the whole text at the stop
    string that ends first (a search as the text grows finds that one; of two ending together, the longer), and
    with one-character pieces the output must equal it."""
    rng = random.Random(seed)
    stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    full = "".join(rng.choice("abcd") for _ in range(30))
    for pieces in ([full[i:i + 1] for i in range(len(full))], _split(full, rng)):
        for include in (False, True):
            shown, out = _run(pieces, stop, include_stop=include)
            assert "".join(shown) == out.text and full.startswith(out.text)
            found = [(full.find(s) + len(s), -len(s), s) for s in stop if s in full]
            if not found:
                assert out.text == full and not out.stopped
                continue
            end, _, s = min(found)
            assert out.stopped
            if len(pieces[0]) == 1 and len(pieces) == len(full):
                assert out.text == full[:end - (0 if include else len(s))]


def _split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
