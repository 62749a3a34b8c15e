"""Media helpers shared by the decode tests: a clip's packets remuxed (no re-encode)."""

import av
import pytest


def _remux(src_path, path, drop: int = 0, raw: bool = False):
    """``src_path``'s video packets into ``path`` without the first ``drop`` (a stream that starts mid-GOP), or as a
    raw Annex-B H.264 stream (no timestamps at all)."""
    src = av.open(str(src_path))
    if raw:
        with open(path, "wb") as out, av.open(str(src_path)) as again:
            bsf = av.BitStreamFilterContext("h264_mp4toannexb", again.streams.video[0])
            for packet in again.demux(again.streams.video[0]):
                for p in bsf.filter(packet if packet.size else None):
                    out.write(bytes(p))
        src.close()
        return path
    with av.open(str(path), "w") as out:
        stream = out.add_stream_from_template(src.streams.video[0])
        for packet in [p for p in src.demux(src.streams.video[0]) if p.size][drop:]:
            packet.stream = stream
            out.mux(packet)
    src.close()
    return path


@pytest.fixture
def remux():
    return _remux
