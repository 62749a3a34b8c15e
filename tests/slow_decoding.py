"""A decoding backend that makes a video's segments finish over time (tests of streamed output and cancels).

Import as ``from slow_decoding import SlowBackend`` (``tests/`` is on ``sys.path``: pytest puts the root
conftest's folder there).
"""

from __future__ import annotations

import time

from flashcodec.decode.backends import Backend, SegmentDecoder, never
from flashcodec.decode.cpu import get_backend


class SlowDecoder(SegmentDecoder):
    """PyAV's decoder, waiting ``delay_s`` before each GOP segment (polling ``should_stop`` as a packet loop
    would), so a video's slices arrive over time."""

    def __init__(self, inner: SegmentDecoder, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def decode_segment(self, segment, emit, should_stop=never):
        deadline = time.monotonic() + self.delay_s
        while time.monotonic() < deadline:
            if should_stop():
                return list(segment.target_indices)
            time.sleep(0.005)
        return self.inner.decode_segment(segment, emit, should_stop)

    def close(self):
        self.inner.close()


class SlowBackend(Backend):
    name = "slow-pyav"

    def __init__(self, delay_s: float):
        self.inner, self.delay_s = get_backend("pyav"), delay_s

    def open(self, source, info, height, width, resize="exact"):
        return SlowDecoder(self.inner.open(source, info, height, width, resize), self.delay_s)
