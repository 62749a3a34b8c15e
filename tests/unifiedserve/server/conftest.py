"""Fixtures shared by the server tests."""

from __future__ import annotations

import pytest

from serve_helpers import openai_client, tiny_clip


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory):
    """A media folder holding ``clip.mp4`` (:func:`serve_helpers.tiny_clip`), written once; tests only read it."""
    d = tmp_path_factory.mktemp("clip")
    tiny_clip(d)
    return d


@pytest.fixture(scope="module")
def client(server):
    """An openai client of the module's ``server`` fixture."""
    return openai_client(server)


@pytest.fixture(scope="module")
def llm():
    """The in-process engine a module checks its server against (built once: its outputs depend on the request
    only)."""
    from unifiedserve.engine import LLM

    return LLM()
