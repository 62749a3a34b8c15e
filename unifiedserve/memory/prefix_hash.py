"""Content hashes of a prompt's full KV blocks, for prefix caching (vLLM-style chained block hashes).

Block ``i`` holds prompt tokens ``[i*B, (i+1)*B)``. Its hash digests the previous block's hash, the
block's token ids and, for its visual tokens, *which media and which of its tokens* they are: the
media's key (``unifiedserve/server/media_key.py``: its content plus every option that changes its
tokens) and the offset of the block's first token of that media. All visual tokens of a kind share one
placeholder id, so token ids alone would let two different videos share KV. Because the chain starts
at the first block, a hash names the whole prefix: equal hashes mean equal token ids, equal media at
equal places, hence equal M-RoPE positions and equal keys and values (same model, same process).

A block that holds a token of media without a key (``""``) cannot be named, and neither can any
block after it: the chain stops there.

When a request ends, the chain goes on over the tokens it generated (they hash as text), so the
blocks its answer filled are cached too and a chat's next turn, which repeats the answer, finds them.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections.abc import Sequence

__all__ = ["block_hashes"]


def block_hashes(token_ids: Sequence[int], block_size: int, media_spans: Sequence[tuple[int, int, str]] = (),
                 visual_positions: Sequence[int] = (), start: Sequence[bytes] = ()) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

    Args:
        token_ids: the prompt, visual placeholders expanded (one token per visual token), and
            possibly tokens generated after it (they hash as text).
        block_size: tokens per KV block.
        media_spans: per media in prompt order, ``(first, count, key)``: its visual tokens are
            ``visual_positions[first:first + count]``; ``key`` is its media key ("" = uncacheable).
        visual_positions: sorted prompt positions of all visual tokens (media order).
        start: the hashes of the first blocks, known already (a prompt's, to extend over its
            outputs): they are returned as they are and the chain goes on from the last.

    Returns:
        One 16-byte hash per full block, from the first, stopping before a block with an unkeyed
        media token.
    """
    # per media: prompt positions of its first and last visual token
    starts = [visual_positions[f] for f, n, _ in media_spans if n]
    spans = [(visual_positions[f], visual_positions[f + n - 1], f, key) for f, n, key in media_spans if n]
    out: list[bytes] = list(start)
    parent = out[-1] if out else b""
    for b in range(len(out), len(token_ids) // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", token_ids[lo:hi]).tobytes())
        # media whose visual tokens overlap [lo, hi): the first with last >= lo, then on while first < hi
        m = max(0, bisect.bisect_right(starts, lo) - 1)
        while m < len(spans) and spans[m][0] < hi:
            first_pos, last_pos, first, key = spans[m]
            if last_pos >= lo:
                if not key:
                    return out
                # the media's index of the block's first token of it
                offset = bisect.bisect_left(visual_positions, max(lo, first_pos)) - first
                h.update(b"\x1fmedia\x1f" + key.encode() + b"\x1f" + str(offset).encode())
            m += 1
        parent = h.digest()
        out.append(parent)
    return out
