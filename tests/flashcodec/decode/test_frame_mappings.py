"""torchcodec's frame mappings from our probe: the text torchcodec reads, the tensors it would parse out of it."""

from __future__ import annotations

import json

import pytest
import torch

import flashcodec
from flashcodec._probe import probe
from flashcodec.decode.pyav import PyAVBackend
from flashcodec.decode.frame_mappings import frame_mappings, use_parsed_mappings
from flashcodec.source import Source


def test_frame_mappings_mark_keyframes_and_durations(tiny_h264):
    info = probe(Source.of(tiny_h264))
    mappings = frame_mappings(info)
    frames = json.loads(mappings)["frames"]
    assert [f["pts"] for f in frames] == info.frame_pts.tolist()
    assert sum(f["key_frame"] for f in frames) == info.num_keyframes
    assert all(f["duration"] > 0 for f in frames)
    assert frame_mappings(info) is mappings  # built once per probe, not per session
    other = probe(Source.of(tiny_h264))
    assert frame_mappings(other) == mappings


def test_frame_mappings_tensors_are_what_torchcodec_parses_from_the_text(tiny_h264):
    from torchcodec.decoders import _video_decoder as vd

    mappings = frame_mappings(probe(Source.of(tiny_h264)))
    hooked = vd._read_custom_frame_mappings
    assert getattr(hooked, "_flashcodec_parsed", False)  # installed by frame_mappings, once
    assert use_parsed_mappings() and vd._read_custom_frame_mappings is hooked
    parsed = hooked(str(mappings))  # plain text: torchcodec's own parse, as for any other caller
    assert len(parsed) == len(mappings.tensors) == 3
    for ours, theirs in zip(mappings.tensors, parsed):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert hooked(mappings) is mappings.tensors  # ours: no parse
    with pytest.raises(ValueError):
        hooked("{}")  # torchcodec's own errors are unchanged


def test_a_decoder_opened_on_parsed_mappings_seeks_exactly(tiny_h264):
    from torchcodec.decoders import VideoDecoder

    info = probe(Source.of(tiny_h264))
    ours = VideoDecoder(tiny_h264, custom_frame_mappings=frame_mappings(info))
    exact = VideoDecoder(tiny_h264, seek_mode="exact")
    assert len(ours) == len(exact) == info.num_frames
    picks = [0, info.num_frames // 2, info.num_frames - 1]
    assert torch.equal(ours.get_frames_at(picks).data, exact.get_frames_at(picks).data)


def test_analyse_prepares_the_ranks_backend_before_any_open(tiny_h264):
    calls = []

    class Recording(PyAVBackend):
        def prepare(self, info):
            calls.append(("prepare", info))
            super().prepare(info)

        def open(self, source, info, height, width, resize="exact"):
            calls.append(("open", info))
            return super().open(source, info, height, width, resize)

    with flashcodec.DecodeEngine(Recording(), 2) as engine:
        analysis = engine.analyse_bitstream(str(tiny_h264), fps=2.0)
        assert calls == [("prepare", analysis.info)]  # at planning: the slots' opens find it built
        engine.add_decoding_request(analysis.key_id)
        engine.get_decoding_output(analysis.key_id)
    assert [kind for kind, _ in calls[1:]] and all(kind == "open" and info is analysis.info for kind, info in calls[1:])
