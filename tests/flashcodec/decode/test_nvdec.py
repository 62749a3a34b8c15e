"""The NVDEC path's device-free logic on CPU: the segment decoder over a CPU torchcodec stand-in,
and the engine with fake GPU ranks (mixed ranks, fallbacks, errors). The same on a GPU:
test_nvdec_cuda.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import flashcodec
from flashcodec.decode import engine as engine_module
from flashcodec.decode import nvdec
from flashcodec.decode import request as request_module
from flashcodec.decode.backends import Backend, SegmentDecoder, emit_many, never
from flashcodec.decode.pyav import PyAVBackend
from flashcodec.devices import DeviceError, canonical_codec, make_layout, nvdec_reject_reason
from flashcodec._probe import probe
from flashcodec.source import Source

TINY = dict(width=128, height=96, duration_s=2.0, fps=24.0, gop=12)


@pytest.fixture
def cpu_torchcodec(monkeypatch):
    """torchcodec's ``VideoDecoder`` with the device forced to the CPU (this machine has no GPU)."""
    tc = pytest.importorskip("torchcodec.decoders")
    devices_asked = []

    class CpuVideoDecoder(tc.VideoDecoder):
        def __init__(self, source, *, device=None, **kwargs):
            devices_asked.append(device)
            super().__init__(source, device="cpu", **kwargs)

    monkeypatch.setattr(tc, "VideoDecoder", CpuVideoDecoder)
    return devices_asked


def decode_all(decoder, plan):
    frames = {}
    failed = []
    for rank in plan.ranks:
        for segment in rank.segments:
            failed += decoder.decode_segment(segment, lambda d, f: frames.__setitem__(d, f.clone()))
    return frames, failed


@pytest.mark.parametrize("rotation", [0, 90, 180])
def test_segment_decoder_matches_the_cpu_exact_path(video_factory, cpu_torchcodec, monkeypatch, rotation):
    monkeypatch.setattr(nvdec, "FRAMES_PER_CALL", 3)  # several calls per segment
    path = video_factory(codec="h264", bframes=2, suffix=".mp4", rotation=rotation, **TINY)
    with flashcodec.DecodeEngine("pyav", num_threads=2) as cpu:
        reference = cpu.decode_video(path, num_frames=10)
        plan = cpu.analyse_bitstream(path, num_frames=10).plan
    info = probe(Source.of(path))
    decoder = nvdec.NvdecSegmentDecoder(Source.of(path), info, plan.height, plan.width, device_index=1)
    frames, failed = decode_all(decoder, plan)
    decoder.close()
    assert cpu_torchcodec == ["cuda:1"] and failed == []
    assert sorted(frames) == sorted(set(plan.frame_indices))
    ours = torch.stack([frames[d] for d in plan.frame_indices]).permute(0, 3, 1, 2).float()  # [T, 3, H, W]
    theirs = reference.frames[:len(plan.frame_indices)].float()
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().mean().item() <= 1.0


@pytest.mark.parametrize("full_falls_back", [False, True])
def test_a_session_on_the_cpu_after_an_open_without_the_decode_is_opened_again_in_full(
        video_factory, monkeypatch, caplog, full_falls_back):
    """torchcodec 0.16's NVDEC interface decodes on the CPU when the codec context has no pixel format, which an
    open without FFmpeg's decode leaves unless fast_open.c sets it. Should a session fall back after such an open,
    a full open decides: on NVDEC, fast opens stop for the process and the full session is used; also on the
    CPU, the fallback was the video's, fast opens stay, and the fallback is said once."""
    import contextlib

    import torchcodec.decoders as tc

    opened = []

    class Status:
        def __init__(self, fallback):
            self.fallback = fallback

        def __bool__(self):
            return self.fallback

        def __str__(self):
            return "Video stream not supported by NVDEC" if self.fallback else "No fallback required"

    class StandIn:
        def __init__(self, source, **kwargs):
            self.fast = len(opened) == 0  # the first is made inside the (faked) armed open
            opened.append(self)
            self.cpu_fallback = Status(self.fast or full_falls_back)

    @contextlib.contextmanager
    def armed(info, depth):
        yield True

    gave_up = []
    monkeypatch.setattr(tc, "VideoDecoder", StandIn)
    monkeypatch.setattr(nvdec.fast_open, "opening", armed)
    monkeypatch.setattr(nvdec.fast_open, "give_up", gave_up.append)
    path = video_factory(codec="h264", bframes=2, suffix=".mp4", **TINY)
    info = probe(Source.of(path))
    with caplog.at_level(logging.WARNING):
        decoder = nvdec.NvdecSegmentDecoder(Source.of(path), info, 32, 32, device_index=0)
    assert len(opened) == 2  # the fast session, then a full one
    if full_falls_back:
        assert gave_up == [] and decoder._decoder is opened[0]
        assert "decodes on the CPU instead of NVDEC" in caplog.text
    else:
        assert len(gave_up) == 1 and "decoded on the CPU" in gave_up[0] and decoder._decoder is opened[1]
        assert "decodes on the CPU instead of NVDEC" not in caplog.text


def _oriented(rotation, mirror=False, height=4, width=6):
    """The orientation fields of a probe of a ``width`` x ``height`` (stored) video."""
    turned = rotation in (90, 270)
    return SimpleNamespace(rotation=rotation, mirror=mirror, display_height=width if turned else height,
                           display_width=height if turned else width)


def test_to_display_turns_only_frames_still_in_stored_orientation():
    stored = torch.arange(2 * 3 * 4 * 6, dtype=torch.uint8).view(2, 3, 4, 6)  # [N, 3, H=4, W=6]
    turned = nvdec.to_display(stored, _oriented(90))
    assert turned.shape == (2, 3, 6, 4) and torch.equal(turned, torch.rot90(stored, 1, dims=(2, 3)))
    already = torch.zeros(2, 3, 6, 4, dtype=torch.uint8)
    assert nvdec.to_display(already, _oriented(270)) is already
    assert nvdec.to_display(stored, _oriented(0)) is stored
    assert nvdec.to_display(stored, _oriented(180)) is stored  # torchcodec made the half turn


@pytest.mark.parametrize("rotation", [0, 90, 180, 270])
def test_to_display_mirrors_what_torchcodec_only_turned(rotation):
    """torchcodec turns a mirrored video by FFmpeg's reading of its matrix (a mirror after a turn by r reads as a
    turn by 180 - r); what comes out of to_display is the turn by r and then the mirror, however torchcodec left it."""
    stored = torch.arange(2 * 3 * 4 * 6, dtype=torch.uint8).view(2, 3, 4, 6)
    display = torch.flip(torch.rot90(stored, rotation // 90, dims=(2, 3)), dims=(3,))
    by_torchcodec = torch.rot90(stored, ((180 - rotation) % 360) // 90, dims=(2, 3))
    assert torch.equal(nvdec.to_display(by_torchcodec, _oriented(rotation, mirror=True)), display)
    if rotation in (90, 270):  # an older torchcodec that turned nothing
        assert torch.equal(nvdec.to_display(stored, _oriented(rotation, mirror=True)), display)


class FlakyDecoder:
    """A torchcodec stand-in: batches containing ``bad`` fail, and so does ``bad`` alone."""

    def __init__(self, bad):
        self.bad = bad

    def get_frames_at(self, indices):
        if self.bad in indices:
            raise RuntimeError("invalid data")
        return type("Batch", (), {"data": torch.zeros(len(indices), 3, 8, 8, dtype=torch.uint8)})()

    def get_frame_at(self, index):
        if index == self.bad:
            raise RuntimeError("invalid data")
        return type("Frame", (), {"data": torch.zeros(3, 8, 8, dtype=torch.uint8)})()


def test_a_corrupt_frame_is_reported_and_its_neighbours_still_come_out(monkeypatch):
    monkeypatch.setattr(nvdec, "FRAMES_PER_CALL", 4)
    decoder = nvdec.NvdecSegmentDecoder.__new__(nvdec.NvdecSegmentDecoder)
    decoder._info = type("Info", (), {"rotation": 0, "mirror": False, "display_height": 8, "display_width": 8})()
    decoder._size = (4, 4)
    decoder._decoder = FlakyDecoder(bad=5)
    segment = flashcodec.plan.segments.GopSegment(0, 9, tuple(range(10)))
    emitted = []
    failed = decoder.decode_segment(segment, lambda d, f: emitted.append((d, tuple(f.shape))))
    assert failed == [5]
    assert [d for d, _ in emitted] == [0, 1, 2, 3, 4, 6, 7, 8, 9] and emitted[0][1] == (4, 4, 3)


# --- the engine with fake GPU ranks ------------------------------------------------------------


class TensorEmitting(SegmentDecoder):
    """PyAV decoding that emits torch tensors in batches of up to 3 frames, as NVDEC ranks do (here on the CPU)."""

    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls

    def decode_segment(self, segment, emit, should_stop=never):
        self.calls.append(segment)
        pending = []

        def flush():
            if pending:
                emit_many(emit, [d for d, _ in pending], torch.stack([f for _, f in pending]))
                pending.clear()

        def collect(display, frame):
            pending.append((display, torch.from_numpy(frame.copy())))
            if len(pending) == 3:
                flush()

        failed = self.inner.decode_segment(segment, collect, should_stop)
        flush()
        return failed

    def close(self):
        self.inner.close()


class FakeNvdecBackend(Backend):
    name = "nvdec"
    calls: dict[str, list] = {}

    def __init__(self, device_index, num_sessions):
        self.device = f"cuda:{device_index}"
        FakeNvdecBackend.calls[self.device] = []

    def open(self, source, info, height, width, resize="exact"):
        return TensorEmitting(PyAVBackend().open(source, info, height, width, resize),
                              FakeNvdecBackend.calls[self.device])


@pytest.fixture
def fake_gpus(monkeypatch, fake_probes, h100_caps):
    """Two fake GPUs with the H100's decoder caps; their NVDEC ranks decode with PyAV on the CPU."""
    monkeypatch.setattr(nvdec, "NvdecBackend", FakeNvdecBackend)
    monkeypatch.setattr(engine_module, "make_layout",
                        lambda devices, *a, **kw: make_layout(devices, *a, **kw, **fake_probes(2)))
    monkeypatch.setattr(engine_module, "video_nvdec_reason",
                        lambda info, gpu: nvdec_reject_reason(canonical_codec(info.codec), info.pix_fmt, info.width,
                                                              info.height, h100_caps))
    return FakeNvdecBackend.calls


def test_gpu_and_cpu_ranks_together_equal_the_cpu_decode(tiny_h264, fake_gpus, monkeypatch):
    batches = []
    one_copy = request_module.DecodeRequest.emit_many
    monkeypatch.setattr(request_module.DecodeRequest, "emit_many",
                        lambda self, displays, frames: (batches.append(len(displays)),
                                                        one_copy(self, displays, frames)))
    with flashcodec.DecodeEngine("pyav", num_threads=2) as cpu:
        reference = cpu.decode_video(tiny_h264, fps=24)
    with flashcodec.DecodeEngine("pyav", devices="cuda,cpu", cpu_threads=2, nvdec_sessions=2,
                                 output_device="cpu", rank_speeds={"cpu": 1000}) as mixed:
        assert mixed.layout.names == ("cuda:0", "cuda:1", "cpu")
        result = mixed.decode_video(tiny_h264, fps=24)
        patches = mixed.decode_video(tiny_h264, fps=24, output="patches")
    assert fake_gpus["cuda:0"] and fake_gpus["cuda:1"]  # both GPU ranks decoded segments
    assert batches and max(batches) == 3  # the GPU ranks' frames went in batches, equal to the CPU's one by one
    assert torch.equal(result.frames, reference.frames)
    assert torch.equal(patches.patches, flashcodec.patches.frames_to_patches(reference.frames)[0])


def test_what_nvdec_cannot_decode_goes_to_the_cpu_with_one_log_line(tiny_av1, tiny_h264, fake_gpus, caplog):
    with flashcodec.DecodeEngine("pyav", devices="cuda", cpu_threads=2, output_device="cpu") as engine:
        assert engine.layout.names == ("cuda:0", "cuda:1", "cpu")
        with caplog.at_level(logging.WARNING, logger="flashcodec.decode.engine"):
            result = engine.decode_video(tiny_av1, num_frames=8)
        h264 = engine.analyse_bitstream(tiny_h264, num_frames=8)
    assert not fake_gpus["cuda:0"] and not fake_gpus["cuda:1"]
    assert [r.getMessage() for r in caplog.records] == [
        f"flashcodec: {tiny_av1} decodes on the CPU rank: NVDEC has no av1 420 8-bit decoder"]
    assert len(result.frame_indices) == 8
    # With "cuda" alone the CPU rank takes only what NVDEC cannot: an H.264 video is all on the GPUs.
    assert h264.plan.ranks[-1].cost == 0 and h264.allowed_ranks == frozenset({0, 1})


@pytest.mark.parametrize("broken", [("cuda:0",), ("cuda:0", "cuda:1")], ids=["one-gpu", "every-gpu"])
def test_a_gpu_that_cannot_open_the_video_leaves_it_to_the_others(tiny_h264, fake_gpus, monkeypatch, broken):
    """NVDEC sessions that cannot be created (another process holds them all, say): with "cuda" the GPUs alone
    take H.264, so a broken GPU's segments go to the other GPU, and once every GPU has failed, to the CPU rank;
    the frames equal the CPU decode either way."""
    real_open = FakeNvdecBackend.open

    def open_or_fail(self, *args, **kwargs):
        if self.device in broken:
            raise RuntimeError(f"{self.device}: no NVDEC session available")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(FakeNvdecBackend, "open", open_or_fail)
    with flashcodec.DecodeEngine("pyav", num_threads=2) as cpu:
        reference = cpu.decode_video(tiny_h264, fps=24)
    with flashcodec.DecodeEngine("pyav", devices="cuda", cpu_threads=2, nvdec_sessions=2,
                                 output_device="cpu") as engine:
        analysis = engine.analyse_bitstream(tiny_h264, fps=24)
        assert analysis.allowed_ranks == frozenset({0, 1})
        engine.cancel(analysis.key_id)
        result = engine.decode_video(tiny_h264, fps=24)
    assert torch.equal(result.frames, reference.frames)
    assert not fake_gpus["cuda:0"] and bool(fake_gpus["cuda:1"]) == (len(broken) == 1)


def test_no_rank_for_a_video_is_a_clear_error(tiny_av1, fake_gpus):
    with flashcodec.DecodeEngine("pyav", devices="cuda:0", cpu_threads=0, output_device="cpu") as engine:
        with pytest.raises(DeviceError, match="NVDEC cannot decode this video .* no CPU rank"):
            engine.analyse_bitstream(tiny_av1, num_frames=4)


def test_device_options_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="cpu_threads"):
        flashcodec.DecodeEngine(devices="cpu", cpu_threads=0)
    with pytest.raises(ValueError, match="not both"):
        flashcodec.DecodeEngine(num_threads=2, cpu_threads=2)
    with pytest.raises(ValueError, match="output_device"):
        flashcodec.DecodeEngine(num_threads=1, output_device="tpu")
    with pytest.raises(ValueError, match="rank_speeds"):
        flashcodec.DecodeEngine(num_threads=1, rank_speeds={"cuda:0": 5.0})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_on_a_machine_without_a_gpu_is_one_error_line(tiny_h264, capsys):
    from flashcodec.cli import main

    with pytest.raises(DeviceError, match="cuda"):
        flashcodec.decode_video(tiny_h264, device="cuda", num_frames=4)
    assert main(["decode", str(tiny_h264), "--device", "cuda", "--num-frames", "4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flashcodec: error: device cuda was asked for")


def test_auto_without_a_gpu_decodes_on_the_cpu(tiny_h264):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    result = flashcodec.decode_video(tiny_h264, device="auto", num_frames=4)
    reference = flashcodec.decode_video(tiny_h264, num_frames=4)
    assert result.frames.device.type == "cpu" and torch.equal(result.frames, reference.frames)
