"""Frame fidelity: flashcodec's frames against Qwen2.5-VL's reference preprocessing.

The reference is computed here, independently of flashcodec: a sequential PyAV decode converted
to full-resolution RGB (the frame's own colour tags), turned to display orientation, then torch
``F.interpolate(bicubic, antialias=True)`` in float32, rounded — what qwen-vl-utils'
``fetch_video`` feeds the model. ``resize="exact"`` must stay within mean 1.0 / p99 8 levels of
it; ``resize="fast"`` is only recorded (and sanity-bounded).
"""

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import flashcodec
from flashcodec.cli import main
from flashcodec.resize import RESIZE_MODES, check_resize_mode, resize_frames, resize_frames_uint8

EXACT_MEAN, EXACT_P99 = 1.0, 8.0

#: (clip width, height, rotation, output (height, width) or None for the Qwen default size)
CLIPS = [
    (426, 240, 0, (252, 420)),  # upscale in height, downscale in width: the example
    (320, 180, 0, (112, 196)),  # downscale
    (250, 140, 0, (168, 308)),  # upscale
    (640, 360, 0, None),  # the Qwen default size for this clip
    (192, 108, 90, (140, 84)),  # rotated: the output is in display orientation
]


def reference_frames(path, indices, height, width) -> torch.Tensor:
    """uint8 ``[N, 3, height, width]``: full-resolution RGB, display orientation, float bicubic+antialias."""
    with av.open(str(path)) as container:
        decoded = list(container.decode(video=0))
    out = []
    for i in indices:
        frame = decoded[i]
        rgb = np.rot90(frame.to_ndarray(format="rgb24"), k=(int(frame.rotation) % 360) // 90)  # [H0, W0, 3]
        x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None].float()  # [1, 3, H0, W0]
        y = F.interpolate(x, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
        out.append(y.round().clamp(0, 255).to(torch.uint8)[0])
    return torch.stack(out)


def error_stats(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float, int]:
    """Mean, 99th percentile and max of |ours - reference| in levels of 255."""
    diff = (ours.to(torch.int16) - reference.to(torch.int16)).abs().numpy()
    return float(diff.mean()), float(np.percentile(diff, 99)), int(diff.max())


@pytest.fixture(scope="module")
def engine():
    with flashcodec.DecodeEngine("pyav", num_threads=2) as e:
        yield e


def _clip(video_factory, width, height, rotation):
    return video_factory(codec="h264", suffix=".mp4", width=width, height=height, duration_s=1.0, fps=12.0,
                         gop=6, bframes=2, rotation=rotation, seed=width)


def _size_kwargs(size):
    return {} if size is None else {"height": size[0], "width": size[1]}


@pytest.mark.parametrize("width,height,rotation,size", CLIPS, ids=[f"{w}x{h}r{r}" for w, h, r, _ in CLIPS])
def test_exact_frames_match_the_reference(video_factory, engine, record_property, width, height, rotation, size):
    path = _clip(video_factory, width, height, rotation)
    exact = engine.decode_video(path, num_frames=6, **_size_kwargs(size))
    n = len(exact.frame_indices)
    reference = reference_frames(path, exact.frame_indices, *exact.frames.shape[2:])
    mean, p99, worst = error_stats(exact.frames[:n], reference)
    record_property("exact", dict(mean=mean, p99=p99, max=worst))
    assert mean <= EXACT_MEAN and p99 <= EXACT_P99, f"exact: mean {mean:.3f}, p99 {p99}, max {worst}"
    if size is not None:
        assert tuple(exact.frames.shape[2:]) == size

    fast = engine.decode_video(path, num_frames=6, resize="fast", **_size_kwargs(size))
    assert fast.frame_indices == exact.frame_indices and fast.frames.shape == exact.frames.shape
    fast_mean, fast_p99, fast_max = error_stats(fast.frames[:n], reference)
    record_property("fast", dict(mean=fast_mean, p99=fast_p99, max=fast_max))
    # fast is not held to exact's bound; it must still be the same pictures, and no closer than exact
    assert fast_mean < 10.0 and fast_mean >= mean


def test_exact_follows_the_streams_colour_tags(tmp_path, engine):
    """A BT.709 full-range stream: exact converts with those tags, not BT.601 limited range."""
    path = tmp_path / "bt709_full.mp4"
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=12)
        stream.width, stream.height, stream.pix_fmt = 160, 96, "yuv420p"
        stream.codec_context.colorspace = 1  # AVCOL_SPC_BT709
        stream.codec_context.color_range = 2  # AVCOL_RANGE_JPEG (full)
        smooth = np.kron(rng.integers(0, 256, (12, 20, 3)), np.ones((8, 8, 1))).astype(np.uint8)  # [96, 160, 3]
        for i in range(6):
            rgb = np.roll(smooth, 4 * i, axis=1)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(
                format="yuv420p", dst_colorspace="ITU709", dst_color_range="JPEG")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with av.open(str(path)) as container:
        first = next(container.decode(video=0))
        assert (int(first.colorspace), int(first.color_range)) == (1, 2)  # the tags survived encoding
    result = engine.decode_video(path, num_frames=6, height=84, width=140)
    reference = reference_frames(path, result.frame_indices, 84, 140)
    mean, p99, _ = error_stats(result.frames, reference)
    assert mean <= EXACT_MEAN and p99 <= EXACT_P99
    # the same pixels read as BT.601 limited range are far off: the tags were used, not defaults
    with av.open(str(path)) as container:
        untagged = [f.to_ndarray(format="rgb24", src_colorspace="ITU601", src_color_range="MPEG")
                    for f in container.decode(video=0)]
    x = torch.from_numpy(np.stack([untagged[i] for i in result.frame_indices])).permute(0, 3, 1, 2)
    wrong_mean, _, _ = error_stats(result.frames, resize_frames(x.contiguous(), 84, 140))
    assert wrong_mean > 4 * max(mean, 0.5)


def test_torchcodec_backend_exact_matches_the_reference(video_factory):
    pytest.importorskip("torchcodec.decoders")
    path = _clip(video_factory, 426, 240, 0)
    with flashcodec.DecodeEngine("torchcodec", num_threads=2) as engine:
        result = engine.decode_video(path, num_frames=6, height=252, width=420)
    reference = reference_frames(path, result.frame_indices, 252, 420)
    mean, p99, worst = error_stats(result.frames, reference)
    assert mean <= EXACT_MEAN and p99 <= EXACT_P99, f"mean {mean:.3f}, p99 {p99}, max {worst}"


@pytest.mark.parametrize("size", [(28, 56), (96, 200), (50, 60)])
def test_resize_frames_is_the_float_reference_and_uint8_kernel_is_close(size):
    frames = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (3, 3, 50, 60), dtype=np.uint8))
    ours = resize_frames(frames, *size)
    assert ours.shape == (3, 3, *size) and ours.dtype == torch.uint8
    expected = F.interpolate(frames.double(), size=size, mode="bicubic", antialias=True,
                             align_corners=False).round().clamp(0, 255).to(torch.uint8)
    assert (ours.int() - expected.int()).abs().max() <= 1  # float32 vs float64 rounding ties only
    if size == (50, 60):
        assert ours is frames  # same size: the reference resize is the identity
    fast = resize_frames_uint8(frames.permute(0, 2, 3, 1).permute(0, 3, 1, 2), *size)  # channels-last input
    mean, p99, _ = error_stats(fast, ours)
    assert mean <= 0.5 and p99 <= 2  # on white noise, the hardest input for fixed point


def test_resize_frames_many_frames_in_chunks():
    frames = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (19, 3, 20, 24), dtype=np.uint8))
    together = resize_frames(frames, 12, 40)
    one_by_one = torch.cat([resize_frames(frames[i:i + 1], 12, 40) for i in range(19)])
    assert torch.equal(together, one_by_one)


@pytest.mark.cuda
def test_resize_frames_on_cuda_matches_cpu():
    frames = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (4, 3, 72, 128), dtype=np.uint8))
    on_gpu = resize_frames(frames.cuda(), 56, 84)
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.uint8
    assert (on_gpu.cpu().int() - resize_frames(frames, 56, 84).int()).abs().max() <= 1


def test_image_exact_is_pil_bicubic_and_fast_is_close(image_factory):
    path = image_factory(".jpg", width=1600, height=1200, seed=3)
    exact = flashcodec.decode_image(path, max_pixels=400 * 300)
    with Image.open(path) as im:
        expected = np.asarray(im.convert("RGB").resize(exact.size[::-1], Image.Resampling.BICUBIC))
    assert np.array_equal(exact.pixels.permute(1, 2, 0).numpy(), expected)  # qwen-vl-utils' image resize
    with Image.open(path) as im:
        full = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)[None]  # [1, 3, H, W]
    torch_reference = F.interpolate(full.float(), size=exact.size, mode="bicubic", antialias=True).round().clamp(0, 255)
    mean, p99, _ = error_stats(exact.pixels[None], torch_reference.to(torch.uint8))
    assert mean <= EXACT_MEAN and p99 <= EXACT_P99  # PIL's kernel is the one torch's antialias copies

    fast = flashcodec.decode_image(path, max_pixels=400 * 300, resize="fast")
    assert fast.size == exact.size and fast.original_size == exact.original_size == (1200, 1600)
    fast_mean, fast_p99, _ = error_stats(fast.pixels, exact.pixels)
    assert 0 < fast_mean < 3.0 and fast_p99 <= 16  # a reduced-scale decode: close, not identical


def test_image_fast_with_exif_rotation_keeps_the_full_size(image_factory, tmp_path):
    path = image_factory(".jpg", width=1200, height=800, seed=4)
    with Image.open(path) as im:
        exif = im.getexif()
        exif[0x0112] = 6  # rotate 90° clockwise to display
        rotated = tmp_path / "rot.jpg"
        im.save(rotated, exif=exif, quality=95)
    exact = flashcodec.decode_image(rotated, max_pixels=200 * 300)
    fast = flashcodec.decode_image(rotated, max_pixels=200 * 300, resize="fast")
    assert exact.original_size == fast.original_size == (1200, 800)
    assert fast.size == exact.size and fast.size[0] > fast.size[1]
    assert error_stats(fast.pixels, exact.pixels)[0] < 3.0


@pytest.mark.parametrize("bad", ["bilinear", "EXACT", "", None, 1])
def test_bad_resize_values_name_the_allowed_ones(tiny_h264, image_factory, engine, bad):
    with pytest.raises(ValueError, match="exact, fast"):
        check_resize_mode(bad)
    with pytest.raises(ValueError, match="exact, fast"):
        engine.decode_video(tiny_h264, num_frames=4, resize=bad)
    key = engine.analyse_bitstream(tiny_h264, num_frames=4).key_id
    with pytest.raises(ValueError, match="exact, fast"):
        engine.add_decoding_request(key, resize=bad)
    engine.add_decoding_request(key)  # the key is still queueable after the refusal
    engine.get_decoding_output(key, timeout=60)
    with pytest.raises(ValueError, match="exact, fast"):
        flashcodec.decode_image(image_factory(".png", width=64, height=48), resize=bad)


def test_resize_frames_rejects_bad_frames_and_sizes():
    with pytest.raises(ValueError, match="uint8"):
        resize_frames(torch.zeros(1, 3, 4, 4), 2, 2)
    with pytest.raises(ValueError, match="uint8"):
        resize_frames(torch.zeros(3, 4, 4, dtype=torch.uint8), 2, 2)
    with pytest.raises(ValueError, match="height"):
        resize_frames(torch.zeros(1, 3, 4, 4, dtype=torch.uint8), 0, 2)
    with pytest.raises(ValueError, match="width"):
        resize_frames_uint8(torch.zeros(1, 3, 4, 4, dtype=torch.uint8), 2, 2.5)


@pytest.mark.parametrize("suffix", [".mp4", ".png"])
def test_cli_resize_flag(tiny_h264, image_factory, capsys, suffix):
    path = tiny_h264 if suffix == ".mp4" else image_factory(".png", width=64, height=48)
    for mode in RESIZE_MODES:
        assert main(["decode", str(path), "--num-frames", "4", "--resize", mode]) == 0
    capsys.readouterr()
    assert main(["decode", str(path), "--num-frames", "4", "--resize", "cubic"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flashcodec: error:") and "exact, fast" in err[0]
