"""Frame selection and target sizes, by the rules Qwen2.5-VL was trained with.

These functions reproduce the behaviour of ``qwen-vl-utils`` 0.0.14 (the reference preprocessing
used by the Qwen2.5-VL model cards), not transformers' own video sampler, which picks different
frames. All functions are pure and work on plain integers.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from flashcodec._errors import NoFramesError

PATCH_SIZE = 14
SPATIAL_MERGE_SIZE = 2
#: Height and width are rounded to multiples of this (one merged 2x2 patch group).
IMAGE_FACTOR = PATCH_SIZE * SPATIAL_MERGE_SIZE  # 28
MAX_RATIO = 200

IMAGE_MIN_PIXELS = 4 * IMAGE_FACTOR**2
IMAGE_MAX_PIXELS = 16384 * IMAGE_FACTOR**2
VIDEO_MIN_PIXELS = 128 * IMAGE_FACTOR**2
VIDEO_MAX_PIXELS = 768 * IMAGE_FACTOR**2
#: Default total pixel budget of a video: 90% of a 128k-token context.
VIDEO_TOTAL_PIXELS = int(128000 * IMAGE_FACTOR**2 * 0.9)

FPS = 2.0
FRAME_FACTOR = 2  # the temporal patch size: frame counts are kept even
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def smart_resize(
    height: int,
    width: int,
    *,
    factor: int = IMAGE_FACTOR,
    min_pixels: int | float = IMAGE_MIN_PIXELS,
    max_pixels: int | float = IMAGE_MAX_PIXELS,
    allow_inverted_budget: bool = False,
) -> tuple[int, int]:
    """Return ``(height, width)`` rounded to multiples of ``factor`` within a pixel budget.

    The aspect ratio is kept as closely as the rounding allows. ``allow_inverted_budget``: accept
    ``min_pixels > max_pixels`` as qwen-vl-utils up to 0.0.11 does for videos (a size above ``max_pixels`` is
    scaled down to it, else one below ``min_pixels`` is scaled up to it).

    Raises:
        ValueError: if either side is not positive, the aspect ratio exceeds 200, or
            ``min_pixels > max_pixels`` (unless allowed).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if min_pixels > max_pixels and not allow_inverted_budget:
        raise ValueError(f"min_pixels ({min_pixels}) must not exceed max_pixels ({max_pixels})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_RATIO:
        raise ValueError(f"aspect ratio must be at most {MAX_RATIO}, got {ratio:.1f} ({width}x{height})")
    h_bar = max(factor, round_by_factor(height, factor))
    w_bar = max(factor, round_by_factor(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, floor_by_factor(height / beta, factor))
        w_bar = max(factor, floor_by_factor(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = ceil_by_factor(height * beta, factor)
        w_bar = ceil_by_factor(width * beta, factor)
    return h_bar, w_bar


#: The largest output frame (pixels) asked for with ``min_pixels``, ``max_pixels`` or ``height x width``:
#: 35,651,584, the most luma samples any H.264 (level 6.2) or HEVC (level 6.2, MaxLumaPs) picture may have
#: (8192x4352; 8K UHD fits). Also the decode engine's default cap on a source's pictures.
MAX_FRAME_PIXELS = 35_651_584


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request video sampling overrides. ``None`` means the model's default.

    Exactly one of ``fps`` and ``num_frames`` may be given.
    """

    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    #: Explicit output size; it is still rounded to multiples of 28.
    height: int | None = None
    width: int | None = None

    def __post_init__(self) -> None:
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("give either fps or num_frames, not both")
        if self.fps is not None and (not isinstance(self.fps, numbers.Real) or isinstance(self.fps, bool)
                                     or not (self.fps > 0 and math.isfinite(self.fps))):
            raise ValueError(f"fps must be a positive number, got {self.fps!r}")
        for name in ("num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels",
                     "height", "width"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (self.height is None) != (self.width is None):
            raise ValueError("give both height and width, or neither")
        for name in ("num_frames", "max_frames"):  # 1 rounded to 0 frames: "cannot sample 0 frames"
            if (getattr(self, name) or FRAME_FACTOR) < FRAME_FACTOR:
                raise ValueError(f"{name} must be at least {FRAME_FACTOR} (one temporal patch of frames), got "
                                 f"{getattr(self, name)}")
        for name in ("min_pixels", "max_pixels"):
            if (getattr(self, name) or 0) > MAX_FRAME_PIXELS:
                raise ValueError(f"{name} must be at most {MAX_FRAME_PIXELS} (8192x4352), got {getattr(self, name)}")
        check_output_size(self.height, self.width)
        if None not in (self.min_frames, self.max_frames) and self.min_frames > self.max_frames:
            raise ValueError(f"min_frames ({self.min_frames}) is above max_frames ({self.max_frames})")


def check_output_size(height: int | None, width: int | None) -> None:
    """An explicit output size (both given, positive) is at most a frame's cap, :data:`MAX_FRAME_PIXELS`: video
    frames and images alike. ValueError otherwise."""
    if height is not None and height * width > MAX_FRAME_PIXELS:
        raise ValueError(f"height x width must be at most {MAX_FRAME_PIXELS} pixels (8192x4352), got {height}x{width}")


def smart_nframes(total_frames: int, video_fps: float, options: SamplingOptions = SamplingOptions()) -> int:
    """Number of frames to sample: ``fps`` frames per second, 4..768, even, at most ``total_frames``.

    Raises:
        NoFramesError: the video has fewer than two frames (a ValueError too).
        ValueError: if fewer than two frames would be sampled.
    """
    if total_frames < FRAME_FACTOR:
        raise NoFramesError(f"the video has {total_frames} frame{'' if total_frames == 1 else 's'}; sampling needs at "
                            f"least {FRAME_FACTOR} (one temporal patch): send a still picture as an image")
    if options.num_frames is not None:
        num_frames = round_by_factor(options.num_frames, FRAME_FACTOR)
    else:
        fps = options.fps if options.fps is not None else FPS
        min_frames = ceil_by_factor(options.min_frames or FPS_MIN_FRAMES, FRAME_FACTOR)
        max_frames = floor_by_factor(
            options.max_frames if options.max_frames is not None else min(FPS_MAX_FRAMES, total_frames),
            FRAME_FACTOR,
        )
        wanted = total_frames / video_fps * fps
        num_frames = floor_by_factor(min(max(wanted, min_frames), max_frames, total_frames), FRAME_FACTOR)
    if not FRAME_FACTOR <= num_frames <= total_frames:
        raise ValueError(
            f"cannot sample {num_frames} frames from a video of {total_frames} frames "
            f"(need between {FRAME_FACTOR} and {total_frames})"
        )
    return num_frames


def linspace_indices(first: int, last: int, count: int) -> list[int]:
    """``torch.linspace(first, last, count).round()`` as a list of ints.

    torch itself is called: its vectorised float32 kernel rounds some ``.5`` ties differently
    from any scalar formula, and the frame indices must agree with the reference exactly.
    """
    import torch

    return torch.linspace(first, last, count).round().long().tolist()


def sample_frame_indices(
    total_frames: int, video_fps: float, options: SamplingOptions = SamplingOptions()
) -> tuple[list[int], float]:
    """Return ``(frame_indices, sample_fps)`` for a video of ``total_frames`` frames at ``video_fps``.

    Indices are display-order positions, ascending (duplicates are possible when more frames
    are asked for than spacing allows).
    """
    if total_frames <= 0:
        raise ValueError("the video has no frames")
    if not (video_fps > 0 and math.isfinite(video_fps)):
        raise ValueError(f"video frame rate must be positive, got {video_fps}")
    num_frames = smart_nframes(total_frames, video_fps, options)
    indices = linspace_indices(0, total_frames - 1, num_frames)
    sample_fps = num_frames / max(total_frames, 1e-6) * video_fps
    return indices, sample_fps


def video_target_size(
    height: int, width: int, num_frames: int, options: SamplingOptions = SamplingOptions()
) -> tuple[int, int]:
    """Output ``(height, width)`` of every sampled frame of a video, multiples of 28.

    The per-frame budget shrinks as the frame count grows so that the whole video stays within
    ``total_pixels``.
    """
    if options.height is not None and options.width is not None:
        return smart_resize(options.height, options.width)
    min_pixels = options.min_pixels if options.min_pixels is not None else VIDEO_MIN_PIXELS
    total_pixels = options.total_pixels if options.total_pixels is not None else VIDEO_TOTAL_PIXELS
    max_pixels = max(min(VIDEO_MAX_PIXELS, total_pixels / num_frames * FRAME_FACTOR), int(min_pixels * 1.05))
    if options.max_pixels is not None:
        max_pixels = min(options.max_pixels, max_pixels)
    # A max_pixels below the default min_pixels: qwen-vl-utils up to 0.0.11 (Qwen2.5-VL's README pins 0.0.8)
    # takes the caller's max_pixels as it is and its smart_resize has no order check, so a frame above
    # max_pixels is scaled down to it, one below min_pixels up to that; served the same here. From 0.0.13 (no
    # 0.0.12 is on PyPI) smart_resize asserts max_pixels >= min_pixels: 0.0.14, whose sampling rules are followed
    # otherwise, fails such a request with an AssertionError.
    size = smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels,
                        allow_inverted_budget=options.min_pixels is None)
    if size[0] * size[1] > MAX_FRAME_PIXELS:  # min_pixels at the cap, rounded up to multiples of 28 (and 5 % over)
        raise ValueError(f"the frames would be {size[0]}x{size[1]} ({size[0] * size[1]} pixels), over the "
                         f"{MAX_FRAME_PIXELS} a frame may have; lower min_pixels")
    return size


def image_target_size(
    height: int, width: int, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> tuple[int, int]:
    """Output ``(height, width)`` of an image, multiples of 28 within the image pixel budget."""
    return smart_resize(
        height,
        width,
        min_pixels=min_pixels if min_pixels is not None else IMAGE_MIN_PIXELS,
        max_pixels=max_pixels if max_pixels is not None else IMAGE_MAX_PIXELS,
    )
