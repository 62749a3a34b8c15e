"""The frame-index code that every synthetic frame and image carries.

The top 3/8 of a frame is a strip of 3 rows x 8 black/white cells that encode
the display index of the frame (18 bits) plus a 6-bit check value.
:func:`draw_frame_index` paints it (``video_frames`` and ``synthetic_image``
call it) and :func:`read_frame_index` recovers the index from a decoded RGB
frame, also after lossy compression and downscaling to 1/4 of the size (the
cells are then about 4x3 pixels for a 128x96 clip).  A frame whose strip does
not carry a valid code (e.g. decoded from corrupted data) raises
:class:`FrameIndexError`.

Standalone (numpy only): put ``datasets/`` on ``sys.path`` and ``import frame_code``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "MAX_FRAMES",
    "FrameIndexError",
    "code_cell_edges",
    "draw_frame_index",
    "read_frame_index",
    "try_read_frame_index",
]

CODE_COLS = 8
CODE_ROWS = 3
#: height of one code row as a fraction of the frame height
CODE_ROW_FRAC = 1.0 / 8.0
INDEX_BITS = 18
CHECK_BITS = 6
MAX_FRAMES = 1 << INDEX_BITS
_CHECK_XOR = 0b101010  # so that all-black / all-white frames are invalid


class FrameIndexError(ValueError):
    """The frame carries no valid frame-index code (corrupt or not ours)."""


def _check_value(index: int) -> int:
    # XOR of the three 6-bit chunks: any single flipped index bit changes
    # exactly one check bit, so single-cell errors are always detected.
    return ((index ^ (index >> 6) ^ (index >> 12)) & 0x3F) ^ _CHECK_XOR


def _code_bits(index: int) -> list[int]:
    if not 0 <= index < MAX_FRAMES:
        raise ValueError(f"frame index {index} out of range [0, {MAX_FRAMES})")
    word = (index << CHECK_BITS) | _check_value(index)
    n = INDEX_BITS + CHECK_BITS
    return [(word >> (n - 1 - k)) & 1 for k in range(n)]  # MSB first, row-major


def _cell_edges(size: int, count: int, step: float) -> list[int]:
    return [int(math.floor(k * step * size + 0.5)) for k in range(count + 1)]


# ---------------------------------------------------------------------------
# drawing
# ---------------------------------------------------------------------------


def code_cell_edges(width: int, height: int) -> tuple[list[int], list[int]]:
    """Pixel edges of the code cells in a ``width`` x ``height`` frame.

    Returns ``(column_edges, row_edges)``: ``CODE_COLS + 1`` and ``CODE_ROWS + 1``
    ascending offsets; the strip ends at ``row_edges[-1]``.
    """
    return _cell_edges(width, CODE_COLS, 1.0 / CODE_COLS), _cell_edges(height, CODE_ROWS, CODE_ROW_FRAC)


def draw_frame_index(
    plane: np.ndarray, index: int, edges: tuple[list[int], list[int]], *, black: int, white: int
) -> None:
    """Paint the code of ``index`` into ``plane`` in place.

    ``plane``: an HxW (e.g. luma) or HxWxC array; ``edges``: its
    :func:`code_cell_edges`; ``black``/``white``: the sample values of 0 and 1
    cells.  Raises ``ValueError`` (before writing anything) if ``index`` is
    not in ``[0, MAX_FRAMES)``.
    """
    bits = _code_bits(index)
    ce, re = edges
    k = 0
    for r in range(CODE_ROWS):
        for c in range(CODE_COLS):
            plane[re[r] : re[r + 1], ce[c] : ce[c + 1]] = white if bits[k] else black
            k += 1


# ---------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------


def _to_hwc_uint8(img: Any) -> np.ndarray:
    """Accept av.VideoFrame, numpy arrays and (CPU/CUDA) torch tensors."""
    if hasattr(img, "to_ndarray") and hasattr(img, "planes"):  # av.VideoFrame
        return img.to_ndarray(format="rgb24")
    if hasattr(img, "detach") and hasattr(img, "cpu"):  # torch.Tensor
        img = img.detach().cpu()
        if getattr(img, "dtype", None) is not None and "bfloat16" in str(img.dtype):
            img = img.float()
        img = img.numpy()
    a = np.asarray(img)
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3:
        raise ValueError(f"expected an HxWxC, CxHxW or HxW image, got shape {a.shape}")
    if a.shape[2] not in (1, 3, 4) and a.shape[0] in (1, 3, 4):
        a = np.moveaxis(a, 0, 2)  # CHW -> HWC
    if a.dtype.kind == "f":
        scale = 255.0 if float(np.nanmax(a)) <= 1.0 + 1e-6 else 1.0
        a = np.clip(np.nan_to_num(a) * scale, 0, 255)
    elif a.dtype == np.uint16:  # 10-bit samples in uint16, or full 16-bit
        a = a >> (2 if int(a.max()) <= 1023 else 8)
    return a


def _inner_pixels(lo: float, hi: float, size: int) -> tuple[int, int]:
    """Pixels lying entirely inside the middle 60% of the span [lo, hi);
    the pixel holding the centre if there are none."""
    m = 0.2 * (hi - lo)
    a, b = math.ceil(lo + m), math.floor(hi - m)
    if b <= a:
        a = min(size - 1, int(math.floor((lo + hi) / 2)))
        b = a + 1
    return max(0, a), min(size, b)


def try_read_frame_index(img: Any, *, rotation: int = 0, mirror: bool = False) -> int | None:
    """Like :func:`read_frame_index` but returns ``None`` instead of raising."""
    try:
        return read_frame_index(img, rotation=rotation, mirror=mirror)
    except FrameIndexError:
        return None


def read_frame_index(img: Any, *, rotation: int = 0, mirror: bool = False) -> int:
    """Recover the display index encoded in a frame made by :func:`make_video`.

    ``img``: an RGB(A) image as HxWxC (or CxHxW) uint8/float array, a grey or
    luma HxW array, a torch tensor or an ``av.VideoFrame``.  Any size works as
    long as a code cell is at least ~3x2 pixels (a 128x96 clip at 1/4 scale is
    fine).  ``rotation``: if the image was rotated for display by ``rotation``
    degrees clockwise (the ``make_video(rotation=...)`` convention), pass the
    same value and it is undone first; ``mirror``: it was also mirrored
    left-right after the rotation (``make_video(mirror=True)``).

    Raises :class:`FrameIndexError` if the check bits do not match.
    """
    a = _to_hwc_uint8(img)
    if mirror:
        a = a[:, ::-1]  # undo the mirror, which came after the rotation
    if rotation % 360:
        if rotation % 90:
            raise ValueError(f"rotation must be a multiple of 90, got {rotation}")
        a = np.rot90(a, k=(rotation // 90) % 4)  # undo a clockwise rotation
    h, w = a.shape[:2]
    cw, ch = w / CODE_COLS, h * CODE_ROW_FRAC
    if cw < 1.0 or ch < 1.0:
        raise FrameIndexError(f"image {w}x{h} too small to carry a frame-index code")
    bits = []
    for r in range(CODE_ROWS):
        y0, y1 = _inner_pixels(r * ch, (r + 1) * ch, h)
        for c in range(CODE_COLS):
            x0, x1 = _inner_pixels(c * cw, (c + 1) * cw, w)
            patch = a[y0:y1, x0:x1].astype(np.float32)
            if patch.shape[2] >= 3:
                luma = (
                    0.299 * patch[..., 0] + 0.587 * patch[..., 1] + 0.114 * patch[..., 2]
                )
            else:
                luma = patch[..., 0]
            bits.append(1 if float(luma.mean()) >= 128.0 else 0)
    word = 0
    for b in bits:
        word = (word << 1) | b
    index, check = word >> CHECK_BITS, word & ((1 << CHECK_BITS) - 1)
    if check != _check_value(index):
        raise FrameIndexError(f"frame-index check failed (read index {index})")
    return index
