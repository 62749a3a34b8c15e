"""A video's display orientation: a quarter-turn rotation and, after it, an optional left-right mirror.

A stream's display matrix (``AV_PKT_DATA_DISPLAYMATRIX``, ISO/IEC 14496-12 §8.3.2 ``tkhd`` matrix) maps a stored
picture to what a player shows. With right angles it is one of eight transforms: four rotations, each with or
without a mirror (a front camera's recording, or a vertical flip, which is a half turn plus a mirror). FFmpeg's
``av_display_rotation_get`` (PyAV's ``VideoFrame.rotation``, torchcodec's auto-rotation) reads only an angle from it:
a left-right mirror reads as a half turn and an up-down mirror as no turn, so the frames come out mirrored. The
``ffmpeg`` command line (autorotate) applies the mirror too; so does flashcodec: the model sees what a viewer sees.

Layout: ``rotation`` is FFmpeg's convention (counter-clockwise degrees, 0/90/180/270) and ``mirror`` flips columns
after the turn: display = ``mirror(rot90(stored, rotation // 90))``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # torch is imported only for tensors: the probe (av + numpy) needs none of it
    import torch


def from_display_matrix(matrix: Sequence[int]) -> tuple[int, bool]:
    """``(rotation, mirror)`` of a 9-integer display matrix (16.16 fixed point), the angle folded to the nearest
    right angle; a matrix that maps the picture to a line (determinant 0) or holds no number is no transform.

    The matrix maps a stored point ``(x, y)`` (y down) to ``(a*x + c*y, b*x + d*y)`` plus a shift, where
    ``a, b, c, d = matrix[0], matrix[1], matrix[3], matrix[4]``. A negative determinant is a mirror: taking the
    mirror off (negating ``a`` and ``c``) leaves the rotation, whose angle is read as FFmpeg reads one.
    """
    a, b, c, d = (float(matrix[i]) for i in (0, 1, 3, 4))
    det = a * d - b * c
    if not math.isfinite(det) or det == 0:
        return 0, False
    mirror = det < 0
    if mirror:
        a, c = -a, -c
    scale0, scale1 = math.hypot(a, c), math.hypot(b, d)
    angle = -math.degrees(math.atan2(b / scale1, a / scale0))  # counter-clockwise, as av_display_rotation_get
    return int(round(angle / 90.0)) * 90 % 360, mirror


def ffmpeg_rotation(rotation: int, mirror: bool) -> int:
    """The angle FFmpeg reads from the matrix of ``(rotation, mirror)`` (what torchcodec turns frames by): a
    mirror after a turn by ``r`` reads as a turn by ``180 - r`` (a left-right mirror is a half turn plus an
    up-down one, and FFmpeg's reading ignores the up-down part)."""
    return (180 - rotation) % 360 if mirror else rotation % 360


def to_display(frames: np.ndarray | torch.Tensor, rotation: int, mirror: bool, axes: tuple[int, int] = (0, 1),
               turned: int = 0) -> np.ndarray | torch.Tensor:
    """``frames`` in display orientation; ``axes`` are their (row, column) axes and ``turned`` the counter-clockwise
    degrees a decoder already turned them by (torchcodec: :func:`ffmpeg_rotation`). A numpy result is contiguous;
    a torch one may be a view. Frames already in display orientation come back as they are."""
    k = ((rotation - turned) // 90) % 4
    if not isinstance(frames, np.ndarray):
        import torch

        out = torch.rot90(frames, k=k, dims=axes) if k else frames
        return torch.flip(out, dims=(axes[1],)) if mirror else out
    out = np.rot90(frames, k=k, axes=axes) if k else frames
    if mirror:
        out = np.flip(out, axis=axes[1])
    return out if out is frames else np.ascontiguousarray(out)
