"""Tests for datasets/synthetic_image.py (seeded still images)."""

from __future__ import annotations

import av
import numpy as np
import pytest

from frame_code import read_frame_index


@pytest.mark.parametrize(
    "suffix,alpha,fmt,mode",
    [
        (".jpg", False, "JPEG", "RGB"),
        (".jpeg", False, "JPEG", "RGB"),
        (".png", False, "PNG", "RGB"),
        (".png", True, "PNG", "RGBA"),
        (".webp", False, "WEBP", "RGB"),
        (".webp", True, "WEBP", "RGBA"),
    ],
)
def test_images(image_factory, suffix, alpha, fmt, mode):
    Image = pytest.importorskip("PIL.Image")
    path = image_factory(suffix, seed=7, alpha=alpha)
    with Image.open(path) as im:
        assert (im.format, im.mode, im.size) == (fmt, mode, (97, 61))
        assert read_frame_index(np.asarray(im.convert("RGB"))) == 7
    with av.open(str(path)) as c:
        f = next(c.decode(video=0))
        assert (f.width, f.height) == (97, 61)
        assert read_frame_index(f) == 7


def test_image_seeds_differ(image_factory):
    a = image_factory(".png", seed=1).read_bytes()
    assert a == image_factory(".png", seed=1).read_bytes()
    assert a != image_factory(".png", seed=2).read_bytes()
    with pytest.raises(ValueError):
        image_factory(".jpg", alpha=True)
    with pytest.raises(ValueError):
        image_factory(".gif")
