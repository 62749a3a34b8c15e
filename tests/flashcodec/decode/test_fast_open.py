"""PyAV's fast H.264 open: FFmpeg's stream-info pass decodes nothing, the reorder depth comes from our probe."""

from __future__ import annotations

import av
import pytest
import torch

from flashcodec import DecodeEngine
from flashcodec._probe import probe
from flashcodec.decode import backends
from flashcodec.source import Source


def _h264(video_factory, bframes, open_gop=False):  # the tiny_* clips' size: 128x96, 2 s at 24 fps, GOPs of 12
    return video_factory(codec="h264", bframes=bframes, open_gop=open_gop, suffix=".mp4", width=128, height=96,
                         duration_s=2.0, fps=24.0, gop=12)


@pytest.mark.parametrize("bframes, depth", [(0, 0), (1, 1), (3, 2)])  # x264's B-pyramid: 3 B-frames hold 2 back
def test_reorder_depth_is_how_far_decode_order_runs_ahead_of_display(video_factory, bframes, depth):
    assert backends.reorder_depth(probe(Source.of(_h264(video_factory, bframes)))) == depth


@pytest.mark.parametrize("bframes, open_gop", [(0, False), (2, False), (3, False), (3, True)])
def test_a_fast_open_decodes_what_a_full_open_decodes(video_factory, monkeypatch, bframes, open_gop):
    path = _h264(video_factory, bframes, open_gop)
    info = probe(Source.of(path))
    opened = []
    real_open = av.open
    monkeypatch.setattr(backends.av, "open", lambda *a, **kw: (opened.append(kw.get("options")), real_open(*a, **kw))[1])
    for indices in (list(range(info.num_frames)), list(range(1, info.num_frames, 5))):  # dense; sparse (NONREF skips)
        with DecodeEngine("pyav", num_threads=2) as engine:
            fast = engine.decode_video(path, frame_indices=indices)
        decoders = [o for o in opened if o is not None]  # the probe's own open is the full one
        assert decoders and all(o == {"skip_frame": "all"} for o in decoders)
        with monkeypatch.context() as full_open:
            full_open.setattr(backends, "FAST_OPEN_OPTIONS", {})
            with DecodeEngine("pyav", num_threads=2) as engine:
                full = engine.decode_video(path, frame_indices=indices)
        assert opened[-1] is None  # the full open's decoders: no options
        assert not fast.failed_frame_indices and not full.failed_frame_indices
        assert torch.equal(fast.frames, full.frames)
        opened.clear()


def test_the_fast_decoder_holds_back_at_least_our_depth(video_factory):
    path = _h264(video_factory, 3)
    info = probe(Source.of(path))
    decoder = backends.PyAVBackend().open(Source.of(path), info, 32, 32)
    try:
        assert decoder._context.reorder_depth >= backends.reorder_depth(info) == 2
    finally:
        decoder.close()
