"""Device parsing, resolution with fake probes, and NVDEC fallback decisions from fake decoder caps."""

import logging

import pytest

from flashcodec import devices
from flashcodec.devices import (
    CPU_THREAD_FPS,
    NVDEC_RANK_FPS,
    DeviceError,
    canonical_codec,
    make_layout,
    nvdec_reject_reason,
    parse_device,
    parse_devices,
    pix_fmt_layout,
    resolve_devices,
)


@pytest.mark.parametrize("text,expected", [("cpu", "cpu"), (" CUDA ", "cuda"), ("cuda:01", "cuda:1"),
                                           ("auto", "auto")])
def test_parse_device(text, expected):
    assert parse_device(text) == expected


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:-1", "cuda:x", "", "mps"])
def test_parse_device_rejects_other_names(bad):
    with pytest.raises(DeviceError, match="cpu, cuda, cuda:N or auto"):
        parse_device(bad)


def test_parse_devices_lists_and_commas_keep_order_without_duplicates():
    assert parse_devices("cuda:1,cpu,cuda:1") == ("cuda:1", "cpu")
    assert parse_devices(["cpu", "cuda:0"]) == ("cpu", "cuda:0")
    with pytest.raises(DeviceError):
        parse_devices([])


def test_resolve_expands_cuda_and_keeps_explicit_ordinals(fake_probes):
    assert resolve_devices("cuda", **fake_probes(2)) == ([0, 1], False, [0, 1])
    assert resolve_devices("cuda:1,cpu", **fake_probes(2)) == ([1], True, [1])
    assert resolve_devices("cpu", **fake_probes(2)) == ([], True, [])
    assert resolve_devices("auto", **fake_probes(2)) == ([0, 1], True, [])


def test_resolve_cuda_without_a_gpu_is_one_clear_error(fake_probes):
    with pytest.raises(DeviceError, match="device cuda was asked for, but no CUDA GPU is visible; use device cpu"):
        resolve_devices("cuda", **fake_probes(0))
    with pytest.raises(DeviceError, match="device cuda:2 was asked for, but there is no cuda:2"):
        resolve_devices("cuda:2", **fake_probes(2))


def test_a_gpu_whose_nvdec_is_unusable_hands_its_work_to_the_cpu(fake_probes, monkeypatch, caplog):
    monkeypatch.setattr(devices, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="flashcodec.devices"):
        resolved = resolve_devices("cuda:0", **fake_probes(1, broken="libnvcuvid.so.1 cannot be loaded"))
        layout = make_layout("cuda:0", 2, **fake_probes(1, broken="libnvcuvid.so.1 cannot be loaded"))
    assert resolved == ([], False, [0])
    assert layout.names == ("cpu",) and layout.cpu_shares and layout.output_gpu == 0  # outputs still on the GPU
    assert [r.getMessage() for r in caplog.records] == [
        "flashcodec: cuda:0's share goes to the CPU rank: NVDEC is not usable there (libnvcuvid.so.1 cannot be loaded)"]
    with pytest.raises(ValueError, match="cpu_threads"):
        make_layout("cuda:0", 0, **fake_probes(1, broken="libnvcuvid.so.1 cannot be loaded"))


def test_auto_falls_back_to_the_cpu_and_logs_the_reason_once(caplog, monkeypatch, fake_probes):
    monkeypatch.setattr(devices, "_logged", set())
    with caplog.at_level(logging.INFO, logger="flashcodec.devices"):
        for _ in range(3):
            assert resolve_devices("auto", **fake_probes(1, broken="torch 2.13 is a CPU-only build")) == ([], True, [])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["flashcodec: device auto decodes on the CPU: NVDEC is not usable "
                     "(torch 2.13 is a CPU-only build)"]


@pytest.mark.parametrize("pix_fmt,layout", [("yuv420p", ("420", 8)), ("yuvj420p", ("420", 8)),
                                            ("yuv420p10le", ("420", 10)), ("yuv444p", ("444", 8)),
                                            ("yuv422p12le", ("422", 12)), ("gray", ("400", 8)),
                                            ("nv12", ("420", 8)), ("p010le", ("420", 10)),
                                            ("rgb24", None), (None, None)])
def test_pix_fmt_layout(pix_fmt, layout):
    assert pix_fmt_layout(pix_fmt) == layout


@pytest.mark.parametrize("codec,pix_fmt,size,why", [
    ("h264", "yuv420p", (1920, 1080), None),
    ("hevc", "yuv420p10le", (3840, 2160), None),
    ("hevc", "yuv444p", (1920, 1080), None),
    ("av1", "yuv420p", (1920, 1080), "NVDEC has no av1 420 8-bit decoder"),
    ("h264", "yuv444p", (1280, 720), "NVDEC has no h264 444 8-bit decoder"),
    ("h264", "yuv420p10le", (1280, 720), "NVDEC has no h264 420 10-bit decoder"),
    ("h264", "yuv420p", (8192, 4320), "8192x4320 is outside NVDEC's h264 limits (48x16 to 4096x4096)"),
    ("mpeg4", "yuv420p", (32, 32), "32x32 is outside NVDEC's mpeg4 limits"),
    ("h264", "rgb24", (640, 480), "pixel format rgb24 is not a YUV format NVDEC decodes"),
])
def test_nvdec_decision_follows_the_h100_caps(codec, pix_fmt, size, why, h100_caps):
    reason = nvdec_reject_reason(codec, pix_fmt, *size, caps=h100_caps)
    if why is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith(why)


def test_nvdec_unusable_here_has_a_reason():
    # This machine's torch is a CPU build or sees no GPU: NVDEC must say why instead of failing later.
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    reason = devices.nvdec_unavailable_reason(0)
    assert reason and ("CPU-only" in reason or "no CUDA GPU" in reason)


def test_a_torchcodec_without_ffmpeg_is_a_reason_not_a_late_failure(monkeypatch):
    """torchcodec >= 0.16 imports without FFmpeg and stubs its FFmpeg ops: that must read as "NVDEC unusable"
    (so ``auto`` decodes on the CPU with one log line), not pass and fail at the first NVDEC call."""
    import sys
    import types

    fake = types.ModuleType("torchcodec")
    fake.__version__, fake.ffmpeg_major_version = "0.16.0", None
    monkeypatch.setitem(sys.modules, "torchcodec", fake)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", types.ModuleType("torchcodec.decoders"))
    assert "finds no FFmpeg libraries" in devices._torchcodec_cuda_reason()
    fake.ffmpeg_major_version = 8
    assert devices._torchcodec_cuda_reason() is None
    fake.__version__ = "0.16.0+cpu"
    assert "CPU-only build" in devices._torchcodec_cuda_reason()


def test_layout_ranks_speeds_and_who_takes_which_video(fake_probes):
    gpu_only = make_layout("cuda", 4, 14, **fake_probes(2))
    assert gpu_only.names == ("cuda:0", "cuda:1", "cpu") and gpu_only.speeds == (NVDEC_RANK_FPS, NVDEC_RANK_FPS,
                                                                                 4 * CPU_THREAD_FPS)
    # "cuda" alone: the CPU rank takes only what NVDEC cannot
    assert gpu_only.shares(lambda gpu: None) == ([NVDEC_RANK_FPS, NVDEC_RANK_FPS, 0.0], frozenset({0, 1}), None)
    speeds, allowed, reason = gpu_only.shares(lambda gpu: "NVDEC has no av1 420 8-bit decoder")
    assert speeds == [0.0, 0.0, 4 * CPU_THREAD_FPS] and allowed == frozenset({2}) and "av1" in reason
    # "cuda:1,cpu" / "auto": GPUs and the CPU share every video, at the speeds given
    both = make_layout("cuda:1,cpu", 8, 7, {"cuda:1": 3000.0, "cpu": 1000.0}, **fake_probes(2))
    assert both.names == ("cuda:1", "cpu") and both.nvdec_sessions == 7
    assert both.shares(lambda gpu: None) == ([3000.0, 1000.0], frozenset({0, 1}), None)
    assert make_layout("auto", 2, **fake_probes(1)).shares(lambda gpu: None)[1] == frozenset({0, 1})


def test_default_cpu_threads_leave_each_gpu_rank_its_host_cores(fake_probes, monkeypatch):
    assert devices.default_cpu_threads(0, cores=16) == 16
    assert devices.default_cpu_threads(1, cores=16) == 16 - devices.NVDEC_HOST_CORES
    assert devices.default_cpu_threads(8, cores=16) == 1  # never none: a video NVDEC cannot take still decodes
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 16)
    assert make_layout("cpu").cpu_threads == 16
    assert make_layout("cuda:0,cpu", **fake_probes(1)).cpu_threads == 16 - devices.NVDEC_HOST_CORES
    assert make_layout("cuda", **fake_probes(2)).cpu_threads == 16 - 2 * devices.NVDEC_HOST_CORES
    assert make_layout("cuda:0,cpu", 16, **fake_probes(1)).cpu_threads == 16  # given: kept


def test_slot_speeds_a_cpu_thread_has_a_core_an_nvdec_session_alone_an_engine(fake_probes):
    layout = make_layout("cuda:1,cpu", 8, 14, {"cuda:1": 2800.0, "cpu": 1000.0}, **fake_probes(2))
    speeds, _, _ = layout.shares(lambda gpu: None)
    asked = []
    assert layout.slot_speeds(speeds, lambda gpu: asked.append(gpu) or 7) == [400.0, 125.0]
    assert asked == [1]  # the GPU the rank runs on
    assert layout.slot_speeds(speeds, lambda gpu: 28) == [200.0, 125.0]  # more engines than sessions
    assert layout.slot_speeds(speeds, lambda gpu: None) == [200.0, 125.0]  # unknown: the sessions share nothing
    # a GPU that does not take the video is not asked about
    no_gpu = layout.slot_speeds([0.0, 1000.0], lambda gpu: pytest.fail("asked"))
    assert no_gpu == [0.0, 125.0]


def test_nvdec_engines_of_a_video_is_none_when_the_driver_cannot_say():
    class Info:
        codec, pix_fmt = "h264", "yuv420p"

    # this machine's answer (no driver here: None; on the device, the driver's count)
    engines = devices.video_nvdec_engines(Info, 0)
    assert engines is None or engines >= 1
    Info.pix_fmt = "rgb24"  # not a YUV layout NVDEC decodes
    assert devices.video_nvdec_engines(Info, 0) is None


def test_layout_errors(fake_probes):
    with pytest.raises(ValueError, match="cpu_threads"):
        make_layout("cpu", 0, **fake_probes(1))
    with pytest.raises(ValueError, match="nvdec_sessions"):
        make_layout("cuda", 2, 0, **fake_probes(1))
    with pytest.raises(ValueError, match="rank_speeds"):
        make_layout("cuda", 2, 4, {"cuda:3": 1.0}, **fake_probes(1))
    with pytest.raises(ValueError, match="rank_speeds"):
        make_layout("cuda", 2, 4, {"cpu": 0}, **fake_probes(1))
    gpu_alone = make_layout("cuda", 0, **fake_probes(1))
    assert gpu_alone.names == ("cuda:0",)
    with pytest.raises(DeviceError, match="no CPU rank"):
        gpu_alone.shares(lambda gpu: "NVDEC has no av1 420 8-bit decoder")


def test_canonical_codec_names_the_codec_not_the_decoder():
    assert canonical_codec("libdav1d") == "av1" and canonical_codec("h264") == "h264"
    assert canonical_codec("no-such-decoder") == "no-such-decoder"
