"""NVDEC on a real GPU: frames equal the CPU path's, stay on the GPU, fall back where NVDEC cannot,
and a corrupt stream leaves the pool usable. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import synthetic_video
import torch

import flashcodec
from flashcodec.devices import nvdec_unavailable_reason
from flashcodec.patches import OPENAI_CLIP_STD

pytestmark = pytest.mark.cuda

#: Large enough for every codec's NVDEC minimum size (HEVC's is 144x144 on many GPUs).
CLIP = dict(width=352, height=288, duration_s=2.0, fps=24.0, gop=12)


@pytest.fixture(scope="module")
def gpu_engine():
    reason = nvdec_unavailable_reason(0)
    if reason is not None:
        pytest.skip(f"NVDEC is not usable here: {reason}")
    with flashcodec.DecodeEngine("pyav", devices="cuda:0", cpu_threads=2, nvdec_sessions=4) as engine:
        yield engine


@pytest.fixture(scope="module")
def cpu_engine():
    with flashcodec.DecodeEngine("pyav", num_threads=2) as engine:
        yield engine


def mean_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().mean().item()


@pytest.mark.parametrize("codec", ["h264", "hevc"])
def test_nvdec_frames_equal_the_cpu_exact_path_and_stay_on_the_gpu(video_factory, gpu_engine, cpu_engine, codec):
    path = video_factory(codec=codec, bframes=2, suffix=".mp4", **CLIP)
    analysis = gpu_engine.analyse_bitstream(path, fps=24)
    assert analysis.allowed_ranks is not None and analysis.plan.ranks[-1].cost == 0  # all on NVDEC
    gpu_engine.add_decoding_request(analysis.key_id)
    ours = gpu_engine.get_decoding_output(analysis.key_id)
    theirs = cpu_engine.decode_video(path, fps=24)
    assert ours.frames.device == torch.device("cuda", 0)
    assert ours.frames.shape == theirs.frames.shape
    assert mean_abs_diff(ours.frames, theirs.frames) <= 1.0
    for row, display in enumerate(ours.frame_indices):
        assert synthetic_video.read_frame_index(ours.frames[row].permute(1, 2, 0).cpu().numpy()) == display


def test_patches_are_made_on_the_gpu(video_factory, gpu_engine, cpu_engine):
    path = video_factory(codec="h264", bframes=2, suffix=".mp4", **CLIP)
    ours = gpu_engine.decode_video(path, num_frames=8, output="patches")
    theirs = cpu_engine.decode_video(path, num_frames=8, output="patches")
    assert ours.patches.device == torch.device("cuda", 0) and ours.grid_thw == theirs.grid_thw
    one_level = 1.0 / 255 / min(OPENAI_CLIP_STD)  # a pixel level after normalising
    assert mean_abs_diff(ours.patches, theirs.patches) <= one_level


@pytest.mark.parametrize("rotation,mirror", [(90, False), (180, False), (0, True), (90, True)])
def test_rotated_video_on_nvdec(video_factory, gpu_engine, cpu_engine, rotation, mirror):
    """Mirrored too: torchcodec turns by FFmpeg's angle only, NvdecSegmentDecoder does the rest."""
    path = video_factory(codec="h264", suffix=".mp4", rotation=rotation, mirror=mirror, **CLIP)
    ours = gpu_engine.decode_video(path, num_frames=6)
    theirs = cpu_engine.decode_video(path, num_frames=6)
    assert ours.frames.shape == theirs.frames.shape
    assert mean_abs_diff(ours.frames, theirs.frames) <= 1.0


def test_av1_goes_to_the_cpu_rank_and_the_output_still_lands_on_the_gpu(video_factory, gpu_engine, cpu_engine):
    from flashcodec.devices import video_nvdec_reason

    path = video_factory(codec="av1", suffix=".mp4", **CLIP)
    analysis = gpu_engine.analyse_bitstream(path, num_frames=8)
    if video_nvdec_reason(analysis.info, 0) is None:
        pytest.skip("this GPU's NVDEC decodes AV1")
    assert analysis.plan.ranks[0].cost == 0 and analysis.allowed_ranks == frozenset({1})
    gpu_engine.add_decoding_request(analysis.key_id)
    ours = gpu_engine.get_decoding_output(analysis.key_id)
    assert ours.frames.device == torch.device("cuda", 0)
    assert torch.equal(ours.frames.cpu(), cpu_engine.decode_video(path, num_frames=8).frames)


def test_corrupt_then_good_on_the_same_pool(video_factory, gpu_engine, cpu_engine, tmp_path):
    good = video_factory(codec="h264", bframes=2, suffix=".mp4", **CLIP)
    # faststart: the index is at the front, so the cut file opens and its tail is missing (a plain mp4 cut short
    # loses its index and is refused at open, before any session sees it)
    indexed = video_factory(codec="h264", bframes=2, suffix=".mp4", faststart=True, **CLIP)
    truncated = synthetic_video.truncate_file(indexed, tmp_path / "cut.mp4", keep_fraction=0.4)
    damaged = synthetic_video.corrupt_middle(good, tmp_path / "corrupt.mp4", seed=3)
    with pytest.raises(flashcodec.CorruptVideoError, match="could not be decoded"):
        gpu_engine.decode_video(truncated, fps=24)
    try:
        cpu_engine.decode_video(damaged, fps=24)
        cpu_fails = False
    except flashcodec.CorruptVideoError:
        cpu_fails = True
    if cpu_fails:  # NVDEC must report the damage as the CPU does, not return garbage frames silently
        with pytest.raises(flashcodec.CorruptVideoError, match="could not be decoded"):
            gpu_engine.decode_video(damaged, fps=24)
    result = gpu_engine.decode_video(good, fps=24)  # the same sessions, right after the failures
    assert mean_abs_diff(result.frames, cpu_engine.decode_video(good, fps=24).frames) <= 1.0


def test_gpu_and_cpu_ranks_together(video_factory, cpu_engine):
    if nvdec_unavailable_reason(0) is not None:
        pytest.skip(nvdec_unavailable_reason(0))
    path = video_factory(codec="h264", bframes=2, suffix=".mp4", **CLIP)
    with flashcodec.DecodeEngine("pyav", devices="cuda:0,cpu", cpu_threads=2, nvdec_sessions=2,
                                 rank_speeds={"cuda:0": 1.0, "cpu": 1.0}) as engine:
        analysis = engine.analyse_bitstream(path, fps=24)
        assert all(rank.cost > 0 for rank in analysis.plan.ranks)  # both ranks have a share
        engine.add_decoding_request(analysis.key_id)
        result = engine.get_decoding_output(analysis.key_id)
    assert mean_abs_diff(result.frames, cpu_engine.decode_video(path, fps=24).frames) <= 1.0


def test_every_visible_gpu_and_a_named_output_device(video_factory, cpu_engine):
    count = torch.cuda.device_count()
    if count < 2 or any(nvdec_unavailable_reason(i) for i in range(count)):
        pytest.skip("needs two GPUs with NVDEC")
    path = video_factory(codec="h264", bframes=2, suffix=".mp4", **CLIP)
    with flashcodec.DecodeEngine("pyav", devices="cuda", cpu_threads=1, nvdec_sessions=2,
                                 output_device=f"cuda:{count - 1}") as engine:
        analysis = engine.analyse_bitstream(path, fps=24)
        assert sum(1 for rank in analysis.plan.ranks[:count] if rank.cost) == count
        engine.add_decoding_request(analysis.key_id)
        result = engine.get_decoding_output(analysis.key_id)
    assert result.frames.device == torch.device("cuda", count - 1)
    assert mean_abs_diff(result.frames, cpu_engine.decode_video(path, fps=24).frames) <= 1.0


def test_module_level_decode_video_on_cuda(video_factory, cpu_engine):
    if nvdec_unavailable_reason(0) is not None:
        pytest.skip(nvdec_unavailable_reason(0))
    path = video_factory(codec="h264", bframes=2, suffix=".mp4", **CLIP)
    ours = flashcodec.decode_video(path, device="cuda", num_frames=8)
    cpu_out = flashcodec.decode_video(path, device="cuda", num_frames=8, output_device="cpu")
    assert ours.frames.is_cuda and cpu_out.frames.device.type == "cpu"
    assert mean_abs_diff(ours.frames, cpu_engine.decode_video(path, num_frames=8).frames) <= 1.0
