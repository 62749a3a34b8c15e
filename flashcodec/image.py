"""Images decoded to the same outputs as video frames: uint8 ``[3, H, W]`` at a Qwen2.5-VL size.

The steps follow the reference preprocessing of Qwen2.5-VL (``qwen-vl-utils``): open with PIL,
make RGB (transparent pixels composited on white), pick the target size with ``smart_resize``
(multiples of 28 within the image pixel budget) and resize with PIL's bicubic filter (the
default ``resize="exact"``). In addition the EXIF orientation is applied, so photos come out the
way viewers show them, as transformers' ``load_image`` (``image_utils.py``) applies it; qwen-vl-utils
does not (a phone's portrait photo reaches the model on its side there).

``resize="fast"`` trades a little fidelity for speed on large downscales: JPEGs are decoded at a
reduced DCT scale (PIL ``draft``, never below the target size) and PIL reduces by an integer
box factor before the bicubic pass (``reducing_gap=2``). Upscales and small downscales of
non-JPEG images come out identical to ``"exact"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from flashcodec._errors import FlashCodecError
from flashcodec.patches import PatchSpec, image_to_patches
from flashcodec.plan.sampling import (IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS, MAX_FRAME_PIXELS, check_output_size,
                                     image_target_size, smart_resize)
from flashcodec.resize import DEFAULT_RESIZE_MODE, check_resize_mode
from flashcodec.source import Source, SourceLike

__all__ = ["DEFAULT_MAX_IMAGE_PIXELS", "DecodedImage", "ImageDecodeError", "decode_image"]

#: Largest image (width * height, as stored) decoded by default: PIL's own hard limit.
DEFAULT_MAX_IMAGE_PIXELS = 178_956_970

#: Modes whose transparency is composited on white rather than dropped.
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})

#: EXIF orientations (tag 0x0112) that swap width and height (transposes and quarter turns).
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})

#: ``resize="fast"``: PIL first reduces by an integer box factor while the image stays at least
#: this many times the target, then resamples bicubic (Pillow's ``reducing_gap``).
_FAST_REDUCING_GAP = 2.0


class ImageDecodeError(FlashCodecError, ValueError):
    """The image data is empty, not an image, damaged, too large or of an unusable shape."""


@dataclass(eq=False)
class DecodedImage:
    """One image at its model input size."""

    #: uint8 ``[3, H, W]`` RGB, contiguous; H and W are multiples of 28.
    pixels: torch.Tensor
    #: ``(height, width)`` of the image as decoded, after EXIF orientation, before resizing.
    original_size: tuple[int, int]

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)`` of :attr:`pixels`."""
        return int(self.pixels.shape[1]), int(self.pixels.shape[2])

    def to_patches(
        self,
        spec: PatchSpec = PatchSpec(),
        out: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Model-ready patches ``[grid_h * grid_w, patch_dim]`` and the grid ``(1, grid_h, grid_w)``."""
        return image_to_patches(self.pixels, spec, out=out, dtype=dtype)

    def __repr__(self) -> str:
        h, w = self.size
        oh, ow = self.original_size
        return (f"DecodedImage(size={h}x{w}, original_size={oh}x{ow}, dtype={self.pixels.dtype}, "
                f"device={self.pixels.device})")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def check_image_options(min_pixels, max_pixels, height, width, max_image_pixels, resize) -> None:
    """Raise ValueError for options :func:`decode_image` (and ``ImageBatchDecoder``) do not take, before any image
    is read."""
    check_resize_mode(resize)
    if (height is None) != (width is None):
        raise ValueError("give both height and width, or neither")
    for name, value in (("height", height), ("width", width), ("max_image_pixels", max_image_pixels)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    check_output_size(height, width)
    _check_pixel_budget("min_pixels", min_pixels)
    _check_pixel_budget("max_pixels", max_pixels)
    low = min_pixels if min_pixels is not None else IMAGE_MIN_PIXELS
    high = max_pixels if max_pixels is not None else IMAGE_MAX_PIXELS
    if height is None and low > high:
        raise ValueError(f"min_pixels ({low}) must not exceed max_pixels ({high})")


def _check_pixel_budget(name: str, value: Any) -> None:
    """A pixel budget is a positive number, at most a video frame's cap (the output is that large: 2 GB of RGB for
    the 2e9 that nothing refused before, from a 3-KB JPEG)."""
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if value is not None and not value <= MAX_FRAME_PIXELS:  # inf and nan too
        raise ValueError(f"{name} must be at most {MAX_FRAME_PIXELS} (8192x4352), got {value!r}")


def _target_size(
    h: int, w: int, min_pixels: int | None, max_pixels: int | None, height: int | None, width: int | None,
    name: str | None = None,
) -> tuple[int, int]:
    try:
        if height is not None and width is not None:
            # As qwen-vl-utils: the requested size is only rounded (with the default budget).
            return smart_resize(height, width)
        return image_target_size(h, w, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as exc:  # the aspect ratio exceeds 200
        raise ImageDecodeError(f"{name}: {exc}" if name else str(exc)) from exc


def _to_rgb(im: Image.Image) -> Image.Image:
    """RGB image; transparent pixels are composited on white. For RGBA that is qwen-vl-utils' ``to_rgb`` (from
    0.0.10; 0.0.8 converted without it); LA, PA and palette or colour-key transparency are composited too, as
    transformers' ``convert_to_rgb`` (``image_transforms.py``) does, where qwen-vl-utils converts them keeping the
    colour under the transparency (often black), so one picture looks the same in whatever mode it was saved."""
    if im.mode in _ALPHA_MODES or "transparency" in im.info:
        rgba = im if im.mode == "RGBA" else im.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return im if im.mode == "RGB" else im.convert("RGB")


def _swaps(im: Image.Image) -> bool:
    """Whether applying the EXIF orientation swaps width and height."""
    try:
        return im.getexif().get(0x0112) in _SWAPPING_ORIENTATIONS
    except Exception:  # unreadable EXIF is ignored when transposing too
        return False


def _draft_for(im: Image.Image, target: tuple[int, int], swapped: bool) -> None:
    """``resize="fast"``: let a JPEG decode at the smallest DCT scale still >= ``target``.

    ``target`` is ``(height, width)`` in display orientation; ``swapped``: the stored image is
    transposed relative to it.
    """
    if im.format == "JPEG":
        th, tw = target
        im.draft(im.mode, (th, tw) if swapped else (tw, th))  # PIL sizes are (width, height)


def _to_tensor(im: Image.Image) -> torch.Tensor:
    """uint8 ``[3, H, W]`` from an RGB PIL image: one copy out of PIL, one transposing copy."""
    hwc = np.asarray(im)  # [H, W, 3] uint8, read-only
    chw = torch.empty((3, im.height, im.width), dtype=torch.uint8)  # [3, H, W]
    chw.numpy()[...] = hwc.transpose(2, 0, 1)  # [3, H, W]
    return chw


def decode_image(
    source: SourceLike,
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    height: int | None = None,
    width: int | None = None,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    resize: str = DEFAULT_RESIZE_MODE,
) -> DecodedImage:
    """Decode an image (JPEG, PNG, WebP, or anything else PIL reads) at its Qwen2.5-VL input size.

    Args:
        source: a path (``str`` / ``os.PathLike``, ``file://`` allowed), ``bytes``, or a binary
            file-like object (read to its end).
        min_pixels, max_pixels: pixel budget of the output; default 4*28*28 .. 16384*28*28.
        height, width: explicit output size instead (both or neither); rounded to multiples of
            28 as qwen-vl-utils does, and ``min_pixels`` / ``max_pixels`` are then not used.
        max_image_pixels: refuse images whose stored width * height exceeds this, before any
            pixel is decoded (``None``: no limit of ours; PIL's global
            ``Image.MAX_IMAGE_PIXELS`` check, which warns above half its hard limit, still applies).
        resize: ``"exact"`` (default): PIL bicubic from the full image, as qwen-vl-utils does;
            ``"fast"``: reduced-scale JPEG decode and box pre-reduction on large downscales
            (module docstring; measured error in docs/flashcodec.md).

    Returns:
        :class:`DecodedImage` with uint8 ``[3, H, W]`` pixels.

    Raises:
        ImageDecodeError: empty data, not an image, truncated or damaged data, zero size, an
            aspect ratio above 200, or more than ``max_image_pixels`` pixels.
        flashcodec.SourceNotFoundError: the path does not exist.
        ValueError: invalid arguments.
    """
    check_image_options(min_pixels, max_pixels, height, width, max_image_pixels, resize)

    src = Source.of(source)
    name = src.name
    if src.num_bytes == 0:
        raise ImageDecodeError(f"{name}: the image is empty")

    try:
        with Image.open(src.open()) as im:
            w, h = im.size
            if w <= 0 or h <= 0:
                raise ImageDecodeError(f"{name}: the image has zero size ({w}x{h})")
            if max_image_pixels is not None and w * h > max_image_pixels:
                raise ImageDecodeError(
                    f"{name}: the image is too large ({w}x{h} = {w * h} pixels, the limit is {max_image_pixels})"
                )
            if height is None:
                _target_size(h, w, min_pixels, max_pixels, None, None, name)  # aspect ratio, before decoding
            if resize == "fast":
                # the target follows from the full size, which draft() would hide: take both first
                swapped = _swaps(im)
                oh, ow = (w, h) if swapped else (h, w)
                target = _target_size(oh, ow, min_pixels, max_pixels, height, width, name)
                _draft_for(im, target, swapped)
            im.load()  # decode now: truncated or corrupt data fails here, not later
            try:
                ImageOps.exif_transpose(im, in_place=True)
            except Exception:  # unreadable EXIF: keep the stored orientation, like most viewers
                pass
            # Everything that touches pixels stays inside `with`: closing the file closes `im`.
            rgb = _to_rgb(im)
            if resize == "fast":
                th, tw = target
                if (th, tw) != (rgb.height, rgb.width):
                    rgb = rgb.resize((tw, th), resample=Image.Resampling.BICUBIC, reducing_gap=_FAST_REDUCING_GAP)
            else:
                oh, ow = rgb.height, rgb.width
                th, tw = _target_size(oh, ow, min_pixels, max_pixels, height, width, name)
                if (th, tw) != (oh, ow):
                    rgb = rgb.resize((tw, th), resample=Image.Resampling.BICUBIC)
            pixels = _to_tensor(rgb)  # [3, th, tw]
    except ImageDecodeError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError(f"{name}: the image is too large ({_one_line(exc)})") from exc
    except Image.UnidentifiedImageError as exc:
        raise ImageDecodeError(f"{name}: not a recognised image format (JPEG, PNG, WebP, ...)") from exc
    except (MemoryError, FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except Exception as exc:  # PIL's decoders raise OSError, SyntaxError, ValueError, EOFError, ...
        raise ImageDecodeError(f"{name}: the image data is truncated or corrupt ({_one_line(exc)})") from exc
    return DecodedImage(pixels=pixels, original_size=(oh, ow))
