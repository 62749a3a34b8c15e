"""Shared pytest fixtures and markers for flashcodec.

* ``datasets/`` is put on ``sys.path`` so tests can ``import synthetic_video`` and its siblings.
* Session-scoped media fixtures (tiny clips, generated once per session into a
  temporary directory): ``video_factory``, ``image_factory``, ``tiny_h264``,
  ``tiny_hevc``, ``tiny_vp9``, ``tiny_av1``, ``tiny_mpeg4``.
* Markers: ``cuda`` (auto-skipped when ``torch.cuda.is_available()`` is
  False) and ``slow`` (runs by default, CI included; deselect locally with
  ``-m "not slow"``).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_DATASETS = str(ROOT / "datasets")
if _DATASETS not in sys.path:
    sys.path.insert(0, _DATASETS)

import synthetic_image  # noqa: E402
import synthetic_video  # noqa: E402

# ---------------------------------------------------------------------------
# markers
# ---------------------------------------------------------------------------


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: slow end-to-end test (deselect with -m 'not slow')")


def _cuda_available() -> bool:
    try:
        import torch
    except Exception:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    need_cuda = [it for it in items if "cuda" in it.keywords]
    if need_cuda and not _cuda_available():
        skip = pytest.mark.skip(reason="CUDA not available (torch.cuda.is_available() is False)")
        for it in need_cuda:
            it.add_marker(skip)


# ---------------------------------------------------------------------------
# media fixtures
# ---------------------------------------------------------------------------


def _key(kwargs: dict) -> str:
    blob = json.dumps(kwargs, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory) -> pathlib.Path:
    """Session temporary directory holding the generated media."""
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="session")
def video_factory(media_dir):
    """``video_factory(**make_video_kwargs, suffix=".mp4") -> Path``.

    Memoised by its arguments for the whole session, so tests asking for the
    same clip share one file.  Keep clips tiny (<= 2 s, <= 160x120).
    """
    cache: dict[str, pathlib.Path] = {}

    def factory(suffix: str = ".mp4", **kwargs) -> pathlib.Path:
        key = _key({"suffix": suffix, **kwargs})
        if key not in cache:
            cache[key] = synthetic_video.cached_video(
                {"suffix": suffix, **kwargs}, cache_dir=media_dir / "videos"
            )
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def image_factory(media_dir):
    """``image_factory(suffix, **make_image_kwargs) -> Path``, memoised."""
    cache: dict[str, pathlib.Path] = {}

    def factory(suffix: str = ".jpg", **kwargs) -> pathlib.Path:
        key = _key({"suffix": suffix, **kwargs})
        if key not in cache:
            out = media_dir / "images" / f"img_{key}{suffix}"
            cache[key] = synthetic_image.make_image(out, **kwargs)
        return cache[key]

    return factory


#: parameters of the ``tiny_*`` fixtures (tests can use them for expectations)
TINY = dict(width=128, height=96, duration_s=2.0, fps=24.0, gop=12)


@pytest.fixture(scope="session")
def tiny_h264(video_factory) -> pathlib.Path:
    """H.264 in mp4, 128x96, 2 s @ 24 fps (48 frames), gop 12, 2 B-frames."""
    return video_factory(codec="h264", bframes=2, suffix=".mp4", **TINY)


@pytest.fixture(scope="session")
def tiny_hevc(video_factory) -> pathlib.Path:
    """HEVC in mp4, 128x96, 2 s @ 24 fps, gop 12, 2 B-frames."""
    return video_factory(codec="hevc", bframes=2, suffix=".mp4", **TINY)


@pytest.fixture(scope="session")
def tiny_vp9(video_factory) -> pathlib.Path:
    """VP9 in webm, 128x96, 2 s @ 24 fps, gop 12."""
    return video_factory(codec="vp9", suffix=".webm", preset="realtime", **TINY)


@pytest.fixture(scope="session")
def tiny_av1(video_factory) -> pathlib.Path:
    """AV1 (SVT-AV1) in mp4, 128x96, 2 s @ 24 fps, gop 12."""
    return video_factory(codec="av1", suffix=".mp4", **TINY)


@pytest.fixture(scope="session")
def tiny_mpeg4(video_factory) -> pathlib.Path:
    """MPEG-4 Part 2 in avi, 128x96, 2 s @ 24 fps, gop 12, 2 B-frames."""
    return video_factory(codec="mpeg4", bframes=2, suffix=".avi", **TINY)
