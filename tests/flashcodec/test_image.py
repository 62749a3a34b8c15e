"""flashcodec.image.decode_image: formats, sources, transparency, EXIF, sizes, errors.

Images are generated (seeded) in temporary directories; the expected pixels come from an
independent PIL pipeline (open, EXIF transpose, convert, bicubic resize) and must match exactly.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from flashcodec.image import DecodedImage, ImageDecodeError, decode_image
from flashcodec.image_batch import ImageBatchDecoder
from flashcodec.patches import PatchSpec, frames_to_patches
from flashcodec.plan.sampling import image_target_size, smart_resize


def _noise(h: int, w: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)


def _encode(im: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _reference(data: bytes, size: tuple[int, int] | None = None) -> torch.Tensor:
    """Expected uint8 [3, H, W] for an opaque image, from PIL directly."""
    im = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    th, tw = size if size is not None else image_target_size(im.height, im.width)
    im = im.resize((tw, th), resample=Image.Resampling.BICUBIC)
    return torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous()


def _png_with_header_size(width: int, height: int) -> bytes:
    """A small valid PNG whose IHDR claims another size (the CRC is fixed up)."""
    data = bytearray(_encode(Image.new("RGB", (2, 2)), "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


FORMATS = [
    ("JPEG", {"quality": 90}),
    ("PNG", {}),
    ("WEBP", {"quality": 80}),
    ("WEBP", {"lossless": True}),
]


@pytest.mark.parametrize("fmt,kwargs", FORMATS, ids=["jpeg", "png", "webp", "webp-lossless"])
def test_formats_match_pil_reference(fmt, kwargs):
    data = _encode(Image.fromarray(_noise(61, 97, seed=1)), fmt, **kwargs)  # 97 wide, 61 tall
    decoded = decode_image(data)
    assert isinstance(decoded, DecodedImage)
    assert decoded.original_size == (61, 97)
    assert decoded.size == (56, 84) == image_target_size(61, 97)
    assert decoded.pixels.dtype == torch.uint8
    assert decoded.pixels.shape == (3, 56, 84)
    assert decoded.pixels.is_contiguous()
    assert torch.equal(decoded.pixels, _reference(data))


def test_lossless_png_at_target_size_is_untouched():
    array = _noise(56, 84, seed=2)
    decoded = decode_image(_encode(Image.fromarray(array), "PNG"))
    assert torch.equal(decoded.pixels, torch.from_numpy(array).permute(2, 0, 1))


def test_sources_give_identical_tensors(tmp_path: Path):
    data = _encode(Image.fromarray(_noise(45, 70, seed=3)), "JPEG")
    path = tmp_path / "photo.jpg"
    path.write_bytes(data)
    results = [
        decode_image(data),
        decode_image(bytearray(data)),
        decode_image(memoryview(data)),
        decode_image(str(path)),
        decode_image(path),
        decode_image(f"file://{path}"),
        decode_image(io.BytesIO(data)),
    ]
    with open(path, "rb") as f:
        results.append(decode_image(f))
    for result in results:
        assert torch.equal(result.pixels, results[0].pixels)
        assert result.original_size == (45, 70)


def test_pixel_budget_and_explicit_size():
    data = _encode(Image.fromarray(_noise(200, 300, seed=4)), "PNG")
    big = decode_image(data)
    assert big.size == image_target_size(200, 300) == (196, 308)
    small = decode_image(data, max_pixels=100 * 28 * 28)
    assert small.size == image_target_size(200, 300, max_pixels=100 * 28 * 28)
    assert small.size[0] * small.size[1] <= 100 * 28 * 28
    assert torch.equal(small.pixels, _reference(data, small.size))
    grown = decode_image(_encode(Image.fromarray(_noise(20, 30, seed=5)), "PNG"), min_pixels=64 * 28 * 28)
    assert grown.size == image_target_size(20, 30, min_pixels=64 * 28 * 28)
    explicit = decode_image(data, height=100, width=150)
    assert explicit.size == smart_resize(100, 150) == (112, 140)
    assert explicit.original_size == (200, 300)
    assert torch.equal(explicit.pixels, _reference(data, (112, 140)))


def test_rgba_png_composited_on_white():
    rgb = _noise(56, 84, seed=6)
    alpha = np.zeros((56, 84), dtype=np.uint8)
    alpha[:, 28:56] = 255  # opaque band
    alpha[:, 56:] = _noise(56, 28, channels=1, seed=7)[..., 0]  # partial transparency
    data = _encode(Image.fromarray(np.dstack([rgb, alpha]), "RGBA"), "PNG")
    pixels = decode_image(data).pixels.permute(1, 2, 0).numpy().astype(np.int32)  # [H, W, 3]
    assert (pixels[:, :28] == 255).all()  # fully transparent -> white
    assert (pixels[:, 28:56] == rgb[:, 28:56]).all()  # opaque -> unchanged
    a = alpha[:, 56:, None].astype(np.float64) / 255
    expected = rgb[:, 56:] * a + 255 * (1 - a)
    assert np.abs(pixels[:, 56:] - expected).max() <= 1  # PIL's integer blend rounds


def test_la_and_palette_transparency_on_white():
    # 56x56: the smallest size the default budget leaves unresized (no resampling blur).
    la = Image.fromarray(np.dstack([np.full((56, 56), 10, np.uint8), np.zeros((56, 56), np.uint8)]), "LA")
    assert (decode_image(_encode(la, "PNG")).pixels == 255).all()
    palette = Image.new("P", (56, 56), 0)
    palette.putpalette([0, 0, 0, 200, 30, 30] + [0] * 762)
    palette.paste(1, (0, 0, 28, 56))  # left half: colour index 1 (opaque red)
    for fmt in ("PNG", "GIF"):
        pixels = decode_image(_encode(palette, fmt, transparency=0)).pixels  # index 0 transparent
        assert pixels.shape == (3, 56, 56)
        assert (pixels[:, :, 28:] == 255).all(), fmt
        assert pixels[:, :, :28].reshape(3, -1).T.unique(dim=0).tolist() == [[200, 30, 30]], fmt
    # Without a transparency key, palette index 0 keeps its colour (black).
    assert (decode_image(_encode(palette, "PNG")).pixels[:, :, 28:] == 0).all()


def test_grayscale_and_cmyk():
    gray = _noise(56, 56, channels=1, seed=8)[..., 0]
    pixels = decode_image(_encode(Image.fromarray(gray, "L"), "PNG")).pixels
    assert all(torch.equal(pixels[c], torch.from_numpy(gray)) for c in range(3))
    cmyk = Image.fromarray(_noise(61, 97, channels=4, seed=13), "CMYK")
    data = _encode(cmyk, "JPEG")
    assert torch.equal(decode_image(data).pixels, _reference(data))


def test_exif_orientation_applied():
    # Stored 84 wide x 56 tall: top half red, bottom half blue. Orientation 6 means "rotate 90
    # degrees clockwise to display", so the displayed image is 56 wide x 84 tall, red on the right.
    stored = np.zeros((56, 84, 3), np.uint8)
    stored[:28] = (255, 0, 0)
    stored[28:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    data = _encode(Image.fromarray(stored), "JPEG", quality=95, exif=exif.tobytes())
    decoded = decode_image(data)
    assert decoded.original_size == (84, 56)
    assert decoded.size == (84, 56)
    assert torch.equal(decoded.pixels, _reference(data))
    p = decoded.pixels.int()
    left, right = p[:, :, :20].float().mean(dim=(1, 2)), p[:, :, 36:].float().mean(dim=(1, 2))
    assert right[0] > 200 and right[2] < 50  # red
    assert left[2] > 200 and left[0] < 50  # blue


def test_patches_equal_frames_repeated():
    decoded = decode_image(_encode(Image.fromarray(_noise(61, 97, seed=9)), "PNG"))
    patches, grid = decoded.to_patches()
    ref, ref_grid = frames_to_patches(decoded.pixels.unsqueeze(0).repeat(2, 1, 1, 1))
    assert grid == ref_grid == (1, 4, 6)
    assert torch.equal(patches, ref)
    half, _ = decoded.to_patches(PatchSpec(), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16


def test_repr():
    decoded = decode_image(_encode(Image.fromarray(_noise(61, 97, seed=10)), "PNG"))
    text = repr(decoded)
    assert "DecodedImage" in text and "56x84" in text and "61x97" in text and "uint8" in text


# --- errors --------------------------------------------------------------------------------------


def _assert_decode_error(excinfo, *words):
    message = str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert message and "\n" not in message
    for word in words:
        assert word in message, message


def test_empty_input(tmp_path: Path):
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(b"")
    _assert_decode_error(excinfo, "empty")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(empty)
    _assert_decode_error(excinfo, "empty", "empty.png")


def test_not_an_image():
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(b"this is plain text, not an image at all")
    _assert_decode_error(excinfo, "not a recognised image")


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_truncated_image(fmt):
    data = _encode(Image.fromarray(_noise(64, 64, seed=11)), fmt)
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(data[: len(data) // 2])
    _assert_decode_error(excinfo)


def test_zero_size_header():
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(_png_with_header_size(0, 5))
    _assert_decode_error(excinfo)


def test_extreme_aspect_ratio():
    data = _encode(Image.new("RGB", (1, 250)), "PNG")
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(data)
    _assert_decode_error(excinfo, "aspect ratio")
    assert str(excinfo.value).startswith(f"<{len(data)} bytes>: aspect ratio must be at most 200")  # names the source
    # Inside the limit the tall strip decodes (to the minimum width of 28).
    assert decode_image(_encode(Image.new("RGB", (1, 200)), "PNG")).size[1] == 28


def test_pixel_cap():
    # Over our cap: refused from the header alone (the pixel data is never decoded).
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(_png_with_header_size(9000, 9000), max_image_pixels=50_000_000)
    _assert_decode_error(excinfo, "too large", "81000000")
    data = _encode(Image.fromarray(_noise(30, 40, seed=12)), "PNG")
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(data, max_image_pixels=1000)
    _assert_decode_error(excinfo, "too large")
    assert decode_image(data, max_image_pixels=1200).original_size == (30, 40)
    # Over PIL's own hard limit (a decompression bomb): PIL's error becomes ours.
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(_png_with_header_size(20000, 20000), max_image_pixels=None)
    _assert_decode_error(excinfo, "too large")


def test_missing_path(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        decode_image(tmp_path / "missing.png")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"height": 100},
        {"width": 100},
        {"height": 0, "width": 100},
        {"min_pixels": 0},
        {"min_pixels": 5000, "max_pixels": 4000},
        {"max_image_pixels": 0},
        # output sizes past a video frame's cap (2e8 pixels of output from a 28x28 PNG took 2.2 GB), inf and nan
        {"min_pixels": 200_000_000, "max_pixels": 200_000_001},
        {"max_pixels": 35_651_585},
        {"min_pixels": float("inf"), "max_pixels": float("inf")},
        {"max_pixels": float("nan")},
        {"height": 10_000, "width": 10_000},
    ],
)
def test_bad_arguments(kwargs):
    data = _encode(Image.new("RGB", (28, 28)), "PNG")
    with pytest.raises(ValueError) as excinfo:
        decode_image(data, **kwargs)
    assert not isinstance(excinfo.value, ImageDecodeError)
    with ImageBatchDecoder("cpu") as batch, pytest.raises(ValueError) as excinfo:  # the same options, the same checks
        batch.decode([data], **kwargs)
    assert not isinstance(excinfo.value, ImageDecodeError)
