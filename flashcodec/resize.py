"""The reference frame resize of Qwen2.5-VL, on any torch device.

Qwen2.5-VL's own preprocessing (qwen-vl-utils ``fetch_video``) decodes frames to full-resolution
RGB and then resizes them with torchvision's ``resize(..., InterpolationMode.BICUBIC,
antialias=True)``: for uint8 input that is torch's antialiased bicubic interpolation computed in
float32, then rounded and clamped back to uint8. :func:`resize_frames` reproduces exactly that,
so frames resized here are the pixels the model was trained on.

``resize`` modes of flashcodec's decode APIs:

- ``"exact"`` (default): convert each sampled frame to full-resolution RGB, then resize it with
  :func:`resize_frames_uint8` on CPU (the cheapest filter measured within the bound of the
  reference, see docs/flashcodec.md).
- ``"fast"``: convert and resize in one swscale call at the target size (cheaper, larger error).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_RESIZE_MODE", "RESIZE_MODES", "check_resize_mode", "resize_frames", "resize_frames_on_device",
           "resize_frames_uint8"]

#: Allowed values of the ``resize`` option, the default first.
RESIZE_MODES = ("exact", "fast")
DEFAULT_RESIZE_MODE = "exact"

#: Frames resized per float32 batch: bounds the temporary memory (about 11 MB a 720p frame).
_FRAMES_PER_CHUNK = 8


def check_resize_mode(mode: str) -> str:
    """Validate a ``resize`` option.

    Args:
        mode: one of :data:`RESIZE_MODES`.

    Returns:
        ``mode`` unchanged.

    Raises:
        ValueError: for any other value; the message names the allowed values.
    """
    if not isinstance(mode, str) or mode not in RESIZE_MODES:
        raise ValueError(f"resize must be one of {', '.join(RESIZE_MODES)}; got {mode!r}")
    return mode


def _check_frames(frames, height, width) -> None:
    if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8 or frames.dim() != 4 \
            or frames.shape[1] != 3:
        shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        dtype = frames.dtype if isinstance(frames, torch.Tensor) else None
        raise ValueError(f"frames must be a uint8 [N, 3, H, W] tensor; got {shape} of {dtype}")
    for name, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int; got {value!r}")


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Resize RGB frames the way Qwen2.5-VL's reference pipeline does.

    Reproduces qwen-vl-utils ``fetch_video``'s torchvision ``resize(BICUBIC, antialias=True)`` of
    uint8 frames: ``F.interpolate(mode="bicubic", antialias=True, align_corners=False)`` in
    float32, rounded to nearest and clamped to 0..255. Works for down- and up-scaling and on any
    device; the computation stays on ``frames.device``.

    Args:
        frames: uint8 ``[N, 3, H, W]`` full-resolution RGB frames, on any device.
        height: output height in pixels (> 0).
        width: output width in pixels (> 0).

    Returns:
        uint8 ``[N, 3, height, width]`` on ``frames.device``, contiguous. When the size already
        matches, ``frames`` itself is returned (the reference resize is the identity then).

    Raises:
        ValueError: ``frames`` is not a uint8 ``[N, 3, H, W]`` tensor, or the size is not positive.
    """
    _check_frames(frames, height, width)
    n, _, h, w = frames.shape
    if (h, w) == (height, width):
        return frames
    out = torch.empty((n, 3, height, width), dtype=torch.uint8, device=frames.device)
    for start in range(0, n, _FRAMES_PER_CHUNK):
        chunk = frames[start:start + _FRAMES_PER_CHUNK].float()  # [n', 3, H, W]
        resized = F.interpolate(chunk, size=(height, width), mode="bicubic", antialias=True,
                                align_corners=False)  # [n', 3, height, width]
        out[start:start + _FRAMES_PER_CHUNK] = resized.round_().clamp_(0, 255).to(torch.uint8)
    return out


def resize_frames_on_device(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """:func:`resize_frames` where the frames are: on a CUDA device as one fused kernel
    (:func:`flashcodec.resize_kernel.resize_frames_fused`: no float32 copy of the full-resolution
    frames) when Triton is installed, else the torch reference itself. Same arguments and result."""
    from flashcodec.resize_kernel import fused_resize_available, resize_frames_fused

    if frames.is_cuda and fused_resize_available(frames.device):
        return resize_frames_fused(frames, height, width)
    return resize_frames(frames, height, width)


def resize_frames_uint8(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The ``"exact"`` mode's CPU resize: torch's native uint8 antialiased bicubic kernel.

    Same filter as :func:`resize_frames` (bicubic, antialias, ``align_corners=False``) but
    computed in uint8 fixed point, 4-6x cheaper on CPU than the float32 reference (2.4 ms vs
    10 ms a frame for 1280x720 -> 728x392, one thread), and within mean 0.13 / p99 1 level of it
    (see docs/flashcodec.md). Frames read from an ``[H, W, 3]`` array through
    ``permute(2, 0, 1)`` are channels-last, the layout this kernel is fastest on.

    Args:
        frames: uint8 ``[N, 3, H, W]`` CPU tensor, any strides.
        height, width: output size in pixels (> 0).

    Returns:
        uint8 ``[N, 3, height, width]``, channels-last in memory when ``frames`` is; ``frames``
        itself when the size already matches.

    Raises:
        ValueError: not a uint8 ``[N, 3, H, W]`` CPU tensor, or a non-positive size.
    """
    _check_frames(frames, height, width)
    if frames.device.type != "cpu":
        raise ValueError(f"resize_frames_uint8 runs on CPU tensors; got {frames.device} "
                         "(use resize_frames on other devices)")
    if tuple(frames.shape[2:]) == (height, width):
        return frames
    return F.interpolate(frames, size=(height, width), mode="bicubic", antialias=True,
                         align_corners=False)  # [N, 3, height, width] uint8
