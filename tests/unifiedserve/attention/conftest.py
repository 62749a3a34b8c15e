"""Fixtures of the attention tests."""

from __future__ import annotations

import types

import pytest

from flashinfer_fakes import FakeDecode, FakePrefill
from unifiedserve.attention import flashinfer_backend as fib


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FlashInferAttention on a CPU cache, with flashinfer's wrappers replaced by the stand-ins."""
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=FakeDecode,
                                 BatchPrefillWithPagedKVCacheWrapper=FakePrefill)
    monkeypatch.setattr(fib, "import_flashinfer", lambda: fake)
    monkeypatch.setattr(fib, "_copy_done_event", lambda device: types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(fib.FlashInferAttention, "_validate_cache", staticmethod(lambda cache: None))
    return fake
