"""Damaged copies of media files, for testing how decoders and servers fail.

:func:`truncate_file` cuts a file's tail off; :func:`corrupt_middle` keeps the
container intact but overwrites the packets of the middle GOP with seeded
random bytes.  Both are deterministic.  Put ``datasets/`` on ``sys.path`` and
``import damaged_media``.
"""

from __future__ import annotations

import pathlib

import numpy as np

__all__ = ["corrupt_middle", "truncate_file"]


def truncate_file(src, dst, keep_fraction: float = 0.5) -> pathlib.Path:
    """Copy the first ``keep_fraction`` of ``src``'s bytes to ``dst``.

    Note that a plain mp4 keeps its index (moov) at the end, so a truncated
    one cannot be opened at all; use ``make_video(..., faststart=True)`` or
    .mkv for a truncated file that still opens and has its tail missing.
    """
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    data = pathlib.Path(src).read_bytes()
    dst = pathlib.Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(data[: int(len(data) * keep_fraction)])
    return dst


def _packet_spans(path) -> list[tuple[int, int, bool]]:
    """(file offset, size, keyframe) of each video packet's payload, in decode order."""
    import av

    raw = pathlib.Path(path).read_bytes()
    spans = []
    with av.open(str(path)) as c:
        for pkt in c.demux(video=0):
            if pkt.size == 0:
                continue
            data = bytes(pkt)
            pos = pkt.pos if pkt.pos is not None and pkt.pos >= 0 else 0
            # pkt.pos may point at a container block header: find the payload
            probe = data[: min(64, len(data))]
            off = raw.find(probe, max(0, pos - 16))
            if off < 0 or raw[off : off + len(data)] != data:
                continue  # payload not stored contiguously; leave it alone
            spans.append((off, len(data), bool(pkt.is_keyframe)))
    return spans


def corrupt_middle(src, dst, *, seed: int = 0) -> pathlib.Path:
    """Copy ``src`` to ``dst`` with the packets of the middle GOP damaged.

    Container structure (headers, index, block headers) is untouched, so the
    file still opens and demuxes to the same packets, but decoding the middle
    GOP yields errors and/or garbage frames (frame-index codes that fail the
    check or disagree with the expected display index).  The keyframe packet
    gets everything after its first few bytes overwritten with seeded random
    bytes; the other packets of the GOP get their second half overwritten.
    With a single GOP the middle third of the packets is damaged instead.
    """
    spans = _packet_spans(src)
    if not spans:
        raise ValueError(f"{src}: no video packets found")
    keys = [i for i, s in enumerate(spans) if s[2]]
    if len(keys) >= 2:
        g = len(keys) // 2
        lo, hi = keys[g], keys[g + 1] if g + 1 < len(keys) else len(spans)
    else:
        lo, hi = len(spans) // 3, max(len(spans) // 3 + 1, 2 * len(spans) // 3)
    data = bytearray(pathlib.Path(src).read_bytes())
    rng = np.random.default_rng([seed, 0xC0AA])
    for j in range(lo, hi):
        off, size, _ = spans[j]
        start = min(8, size // 4) if j == lo else size // 2
        n = size - start
        if n > 0:
            data[off + start : off + size] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    dst = pathlib.Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(bytes(data))
    return dst
