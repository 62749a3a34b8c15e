"""Display matrices to (rotation, mirror), and frames to display orientation."""

import numpy as np
import pytest
import torch

from flashcodec import orientation

ONE, W = 1 << 16, 1 << 30
#: What PyAV's ``set_display_rotation(degrees, hflip, vflip)`` writes (read back from decoded frames' side data),
#: with the orientation that call means: a counter-clockwise turn, then a left-right mirror; a vertical flip is a
#: half turn plus that mirror. ``ffmpeg`` (autorotate) showed each of these files that way.
MATRICES = [
    ((ONE, 0, 0, 0, ONE, 0, 0, 0, W), (0, False)),
    ((0, -ONE, 0, ONE, 0, 0, 0, 0, W), (90, False)),  # set_display_rotation(90)
    ((-ONE, 0, 0, 0, -ONE, 0, 0, 0, W), (180, False)),
    ((0, ONE, 0, -ONE, 0, 0, 0, 0, W), (270, False)),
    ((-ONE, 0, 0, 0, ONE, 0, 0, 0, W), (0, True)),  # hflip: FFmpeg reads -180
    ((ONE, 0, 0, 0, -ONE, 0, 0, 0, W), (180, True)),  # vflip: FFmpeg reads 0
    ((0, -ONE, 0, -ONE, 0, 0, 0, 0, W), (90, True)),  # 90 + hflip: FFmpeg reads 90
    ((0, ONE, 0, ONE, 0, 0, 0, 0, W), (270, True)),
]


@pytest.mark.parametrize("matrix,expected", MATRICES)
def test_display_matrix_to_rotation_and_mirror(matrix, expected):
    assert orientation.from_display_matrix(matrix) == expected


def test_scaled_odd_angled_and_degenerate_matrices():
    c = int(round(ONE * np.cos(np.radians(80)))), int(round(ONE * np.sin(np.radians(80))))
    assert orientation.from_display_matrix((c[0], -c[1], 0, c[1], c[0], 0, 0, 0, W)) == (90, False)  # 80: nearest
    assert orientation.from_display_matrix((3 * ONE, 0, 0, 0, ONE // 2, 0, 0, 0, W)) == (0, False)  # a scale only
    assert orientation.from_display_matrix((0,) * 9) == (0, False)  # maps every point to one: no transform
    assert orientation.from_display_matrix((ONE, ONE, 0, ONE, ONE, 0, 0, 0, W)) == (0, False)  # onto a line


@pytest.mark.parametrize("matrix,expected", MATRICES)
def test_ffmpeg_rotation_is_the_angle_ffmpeg_reads(matrix, expected):
    """What av_display_rotation_get returns (counter-clockwise, scale-free), folded to 0..359."""
    a, b, c, d = matrix[0], matrix[1], matrix[3], matrix[4]
    read = -np.degrees(np.arctan2(b / np.hypot(b, d), a / np.hypot(a, c)))
    assert orientation.ffmpeg_rotation(*expected) == int(round(read)) % 360


@pytest.mark.parametrize("rotation", [0, 90, 180, 270])
@pytest.mark.parametrize("mirror", [False, True])
def test_to_display_numpy_and_torch_agree_and_undo_a_decoders_turn(rotation, mirror):
    stored = np.arange(2 * 4 * 6 * 3, dtype=np.uint8).reshape(2, 4, 6, 3)  # [N, H, W, C]
    display = np.rot90(stored, rotation // 90, axes=(1, 2))
    display = display[:, :, ::-1] if mirror else display
    ours = orientation.to_display(stored, rotation, mirror, axes=(1, 2))
    assert ours.flags.c_contiguous and np.array_equal(ours, display)
    as_torch = orientation.to_display(torch.from_numpy(stored), rotation, mirror, axes=(1, 2))
    assert torch.equal(as_torch, torch.from_numpy(display.copy()))
    turned = orientation.ffmpeg_rotation(rotation, mirror)
    by_decoder = np.rot90(stored, turned // 90, axes=(1, 2))
    assert np.array_equal(orientation.to_display(by_decoder, rotation, mirror, axes=(1, 2), turned=turned), display)
    if not mirror and rotation == 0:
        assert orientation.to_display(stored, 0, False, axes=(1, 2)) is stored
