"""flashcodec.patches against transformers' Qwen2-VL processors and a loop-by-loop reference.

References (all built locally from config values, nothing is downloaded):

* ``Qwen2VLImageProcessorPil`` (transformers' NumPy/PIL image processor; ``Qwen2VLImageProcessor``
  resolves to it when torchvision is missing) with ``do_resize=False``: image inputs are
  compared directly, and video inputs frame by frame (see ``test_video_matches_image_processor_per_frame``).
* ``Qwen2VLVideoProcessor``: transformers implements it with torchvision, which cannot be installed
  next to torch 2.13 here, so its direct comparison is skipped when torchvision is absent.
* ``_reference_patches``: the layout written out as plain Python loops over the definition.

Tolerance: ``atol=1e-5, rtol=0``. transformers rescales in float64 and normalises as
``(x * (1/255) - mean) / std``; flashcodec computes ``x * scale + bias`` in float32. The largest
absolute difference observed over every comparison in this file is 2.4e-7 (values lie in about
[-1.8, 2.2], so that is one or two float32 ulps).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from flashcodec.patches import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PatchSpec,
    frames_to_patches,
    image_to_patches,
    num_patches,
    num_visual_tokens,
)

ATOL = 1e-5
SIZES = [(28, 28), (56, 84), (112, 56), (84, 140)]


def _random_frames(t: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (t, 3, h, w), dtype=torch.uint8, generator=g)  # [T, 3, H, W]


def _image_processor(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(do_resize=False, **kwargs)


def _hf_image(proc, image: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """transformers' patches and grid for one uint8 [3, H, W] image."""
    out = proc(images=[image.numpy()], input_data_format="channels_first", return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"][0].tolist()


def _reference_patches(frames: torch.Tensor, spec: PatchSpec) -> torch.Tensor:
    """The Qwen2-VL layout from its definition, one row at a time (float64)."""
    tp, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    t = frames.shape[0]
    if t % tp:
        frames = torch.cat([frames, frames[-1:].expand(tp - t % tp, -1, -1, -1)])
    mean = torch.tensor(spec.image_mean, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(spec.image_std, dtype=torch.float64).view(1, 3, 1, 1)
    x = (frames.double() * spec.rescale_factor - mean) / std  # [T', 3, H, W]
    gh, gw = frames.shape[2] // p, frames.shape[3] // p
    rows = []
    for g in range(frames.shape[0] // tp):
        for bh in range(gh // m):
            for bw in range(gw // m):
                for mh in range(m):
                    for mw in range(m):
                        y, xx = (bh * m + mh) * p, (bw * m + mw) * p
                        block = x[g * tp : (g + 1) * tp, :, y : y + p, xx : xx + p]  # [tp, C, p, p]
                        rows.append(block.permute(1, 0, 2, 3).reshape(-1))  # [C, tp, p, p] flattened
    return torch.stack(rows)


# --- against transformers' image processor -------------------------------------------------------


@pytest.mark.parametrize("h,w", SIZES)
def test_image_matches_transformers(h, w):
    image = _random_frames(1, h, w, seed=h * 1000 + w)[0]  # [3, H, W]
    ref, ref_grid = _hf_image(_image_processor(), image)
    patches, grid = image_to_patches(image)
    assert patches.dtype == torch.float32
    assert patches.shape == ref.shape == (h // 14 * (w // 14), 1176)
    assert list(grid) == ref_grid == [1, h // 14, w // 14]
    assert torch.allclose(patches, ref, rtol=0, atol=ATOL), (patches - ref).abs().max()


@pytest.mark.parametrize("t", [1, 2, 5, 7])
@pytest.mark.parametrize("h,w", SIZES[:3])
def test_video_matches_image_processor_per_frame(t, h, w):
    """Every value of a video's patches checked against transformers' image processor.

    The image processor repeats one frame over the temporal slots of each row. So for frame k
    (after padding T up to a multiple of 2 by repeating the last frame, as Qwen does), the slot
    ``k % 2`` of the rows of frame pair ``k // 2`` must equal the image processor's output for
    frame k alone. Together these cover every value and fix the row order within each pair; the
    pair order is the grid_t axis.
    """
    proc = _image_processor()
    frames = _random_frames(t, h, w, seed=t)
    patches, grid = frames_to_patches(frames)
    grid_t, grid_h, grid_w = grid
    assert grid == ((t + 1) // 2, h // 14, w // 14)
    assert patches.shape == (grid_t * grid_h * grid_w, 1176)
    ours = patches.view(grid_t, grid_h * grid_w, 3, 2, 14, 14)
    padded = list(frames) + [frames[-1]] * (2 * grid_t - t)
    for k, frame in enumerate(padded):
        ref, ref_grid = _hf_image(proc, frame)
        assert ref_grid == [1, grid_h, grid_w]
        ref = ref.view(grid_h * grid_w, 3, 2, 14, 14)[:, :, 0]  # [hw, C, p, p]
        got = ours[k // 2, :, :, k % 2]  # [hw, C, p, p]
        assert torch.allclose(got, ref, rtol=0, atol=ATOL), (k, (got - ref).abs().max())


def _video_processor():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchvision  # noqa: F401
            from transformers import Qwen2VLVideoProcessor

            return Qwen2VLVideoProcessor(do_resize=False, do_sample_frames=False)
    except Exception as exc:  # ImportError, or transformers' placeholder raising without torchvision
        pytest.skip(f"transformers' Qwen2VLVideoProcessor needs torchvision: {exc}")


@pytest.mark.parametrize("t", [5, 7])
@pytest.mark.parametrize("h,w", SIZES[:3])
def test_video_matches_transformers_video_processor(t, h, w):
    proc = _video_processor()
    frames = _random_frames(t, h, w, seed=100 + t)
    out = proc(videos=[frames], return_tensors="pt", cap_pixels_per_frame=False)
    ref, ref_grid = out["pixel_values_videos"], out["video_grid_thw"][0].tolist()
    patches, grid = frames_to_patches(frames)
    assert list(grid) == ref_grid
    assert torch.allclose(patches, ref, rtol=0, atol=ATOL), (patches - ref).abs().max()


def test_other_spec_matches_transformers():
    """A non-default geometry and normalisation (patch 16, factor 32, ImageNet-like stats)."""
    cfg = {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.4, 0.3],
        "image_std": [0.2, 0.25, 0.3],
    }
    spec = PatchSpec.from_preprocessor_config(cfg)
    image = _random_frames(1, 64, 96, seed=3)[0]
    ref, ref_grid = _hf_image(_image_processor(**cfg), image)
    patches, grid = image_to_patches(image, spec)
    assert list(grid) == ref_grid == [1, 4, 6]
    assert patches.shape == ref.shape == (24, 3 * 2 * 16 * 16)
    assert torch.allclose(patches, ref, rtol=0, atol=ATOL)


# --- against the loop reference -----------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 3, 4])
def test_matches_loop_reference(t):
    frames = _random_frames(t, 56, 84, seed=7)
    patches, _ = frames_to_patches(frames)
    ref = _reference_patches(frames, PatchSpec())
    assert torch.allclose(patches.double(), ref, rtol=0, atol=ATOL)


def test_matches_loop_reference_other_geometry():
    spec = PatchSpec(patch_size=4, temporal_patch_size=3, merge_size=3, image_mean=(0.1, 0.2, 0.3),
                     image_std=(0.5, 0.6, 0.7))
    frames = _random_frames(4, 24, 36, seed=9)  # T=4 -> padded to 6
    patches, grid = frames_to_patches(frames, spec)
    assert grid == (2, 6, 9)
    assert patches.shape == (2 * 6 * 9, spec.patch_dim)
    assert torch.allclose(patches.double(), _reference_patches(frames, spec), rtol=0, atol=ATOL)


def test_image_equals_frame_repeated():
    image = _random_frames(1, 56, 84, seed=11)[0]
    a, grid_a = image_to_patches(image)
    b, grid_b = frames_to_patches(torch.stack([image, image]))
    assert grid_a == grid_b == (1, 4, 6)
    assert torch.equal(a, b)
    # A single frame as a "video" is padded with itself: the same result.
    c, _ = frames_to_patches(image.unsqueeze(0))
    assert torch.equal(a, c)


def test_strided_frames_give_same_result():
    frames = _random_frames(3, 56, 28, seed=12)
    channels_last = frames.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # [T, 3, H, W], HWC memory
    assert not channels_last.is_contiguous()
    assert torch.equal(frames_to_patches(frames)[0], frames_to_patches(channels_last)[0])


# --- out= and dtype ------------------------------------------------------------------------------


def test_out_buffer_slice():
    frames = _random_frames(5, 28, 56, seed=13)
    expected, grid = frames_to_patches(frames)
    n = num_patches(grid)
    buffer = torch.full((n + 10, 1176), -7.0)
    patches, grid2 = frames_to_patches(frames, out=buffer[4 : 4 + n])
    assert grid2 == grid
    assert patches.data_ptr() == buffer[4].data_ptr()
    assert torch.equal(buffer[4 : 4 + n], expected)
    assert (buffer[:4] == -7).all() and (buffer[4 + n :] == -7).all()


def test_out_dtype_is_used():
    frames = _random_frames(2, 28, 28, seed=14)
    out = torch.empty(4, 1176, dtype=torch.float64)
    patches, _ = frames_to_patches(frames, out=out, dtype=torch.float32)
    assert patches.dtype == torch.float64


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2**-8 * 2.2), (torch.float16, 2**-11 * 2.2)])
def test_low_precision_output(dtype, atol):
    frames = _random_frames(3, 56, 56, seed=15)
    full, _ = frames_to_patches(frames)
    low, _ = frames_to_patches(frames, dtype=dtype)
    assert low.dtype == dtype
    # One rounding of the float32 result: at most half an ulp of values below 2.2 in magnitude.
    assert (low.float() - full).abs().max() <= atol


def test_bad_out_rejected():
    frames = _random_frames(2, 28, 28)
    with pytest.raises(ValueError, match="shaped"):
        frames_to_patches(frames, out=torch.empty(5, 1176))
    with pytest.raises(ValueError, match="floating"):
        frames_to_patches(frames, out=torch.empty(4, 1176, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        frames_to_patches(frames, out=torch.empty(1176, 4).t())


@pytest.mark.parametrize(
    "frames,match",
    [
        (torch.zeros(2, 3, 28, 28, dtype=torch.float32), "uint8"),
        (torch.zeros(3, 28, 28, dtype=torch.uint8), r"\[T, 3, H, W\]"),
        (torch.zeros(2, 4, 28, 28, dtype=torch.uint8), r"\[T, 3, H, W\]"),
        (torch.zeros(0, 3, 28, 28, dtype=torch.uint8), "empty"),
        (torch.zeros(2, 3, 28, 42, dtype=torch.uint8), "multiple of 28"),
        (torch.zeros(2, 3, 14, 28, dtype=torch.uint8), "multiple of 28"),
    ],
)
def test_bad_frames_rejected(frames, match):
    with pytest.raises(ValueError, match=match):
        frames_to_patches(frames)


def test_bad_image_rejected():
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        image_to_patches(torch.zeros(1, 3, 28, 28, dtype=torch.uint8))


# --- PatchSpec and counting ----------------------------------------------------------------------


def test_default_spec():
    spec = PatchSpec()
    assert spec.patch_dim == 1176
    assert spec.factor == 28
    assert spec.image_mean == OPENAI_CLIP_MEAN and spec.image_std == OPENAI_CLIP_STD
    assert hash(spec) == hash(PatchSpec())


def test_from_qwen25_vl_preprocessor_config():
    # The keys of Qwen2.5-VL's preprocessor_config.json.
    cfg = {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    }
    assert PatchSpec.from_preprocessor_config(cfg) == PatchSpec()
    assert PatchSpec.from_preprocessor_config({}) == PatchSpec()
    plain = PatchSpec.from_preprocessor_config({"do_rescale": False, "do_normalize": False})
    patches, _ = image_to_patches(torch.full((3, 28, 28), 200, dtype=torch.uint8), plain)
    assert (patches == 200).all()


def test_spec_validation():
    with pytest.raises(ValueError):
        PatchSpec(patch_size=0)
    with pytest.raises(ValueError):
        PatchSpec(image_mean=(0.5, 0.5))
    with pytest.raises(ValueError):
        PatchSpec(image_std=(0.5, 0.0, 0.5))


def test_counts():
    assert num_patches((3, 4, 6)) == 72
    assert num_visual_tokens((3, 4, 6)) == 18
    assert num_patches(torch.tensor([3, 4, 6])) == 72
    grids = torch.tensor([[1, 4, 6], [2, 2, 2]])
    assert num_patches(grids) == 24 + 8
    assert num_visual_tokens(grids) == 6 + 2
    assert num_visual_tokens([(1, 6, 6)], merge_size=3) == 4
    frames = _random_frames(5, 56, 84)
    patches, grid = frames_to_patches(frames)
    assert patches.shape[0] == num_patches(grid)


def test_random_shapes_against_loop_reference():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=15, deadline=None, derandomize=True)
    @hypothesis.given(t=st.integers(1, 5), bh=st.integers(1, 3), bw=st.integers(1, 3), seed=st.integers(0, 99))
    def check(t, bh, bw, seed):
        frames = _random_frames(t, 28 * bh, 28 * bw, seed=seed)
        patches, grid = frames_to_patches(frames)
        assert grid == ((t + 1) // 2, 2 * bh, 2 * bw)
        assert torch.allclose(patches.double(), _reference_patches(frames, PatchSpec()), rtol=0, atol=ATOL)

    check()


def test_no_warnings():
    # Sanity: the public functions emit no warnings on ordinary input.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frames_to_patches(_random_frames(3, 28, 28))
        image_to_patches(torch.from_numpy(np.zeros((3, 28, 28), dtype=np.uint8)))
