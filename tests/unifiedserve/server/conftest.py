"""Fixtures shared by the server tests."""

from __future__ import annotations

import pytest

from serve_helpers import tiny_clip


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory):
    """A media folder holding ``clip.mp4`` (:func:`serve_helpers.tiny_clip`), written once; tests only read it."""
    d = tmp_path_factory.mktemp("clip")
    tiny_clip(d)
    return d
