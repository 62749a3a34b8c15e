"""paged_scatter / paged_gather: native (csrc/paged_copy.cpp) against the torch reference, and the fallback."""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from unifiedserve import ops
from unifiedserve.memory.pages import PageAllocator, PagedStream, RaggedIndex, plan_read, plan_write
from unifiedserve.ops import RaggedIndexTensors, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="session")
def native():
    """The native ops, built once per session (seconds the first time, then cached on disk)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None or os.environ.get("UNIFIEDSERVE_NO_NATIVE"):
        pytest.skip("no C++ compiler, or UNIFIEDSERVE_NO_NATIVE is set")
    assert ops.native_available(), f"a compiler is present but the build failed: {ops.build_info()['reason']}"
    return torch.ops.unifiedserve


def random_index(rng: random.Random, num_pages: int, page_size: int) -> RaggedIndex:
    """A batch of up to 5 requests, each starting at any token position, on distinct random pages."""
    free = list(range(num_pages))
    rng.shuffle(free)
    spans = []
    for _ in range(rng.randint(0, 5)):
        cu = rng.randint(0, 3 * page_size)
        n = rng.choice([0, 1, page_size - 1, page_size, page_size + 1, rng.randint(0, 4 * page_size)])
        need = 0 if n == 0 else -(-(cu % page_size + n) // page_size)
        if need > len(free):
            break
        spans.append((n, cu, [free.pop() for _ in range(need)]))
    return RaggedIndex.build(spans, page_size)


def random_tensor(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_native_matches_reference(native, dtype, page_size):
    rng, gen = random.Random(page_size), torch.Generator().manual_seed(page_size)
    for trial in range(20):
        feature = [(3,), (7,), (2, 5), ()][trial % 4]  # trailing dims of a row; () = one element per row
        num_pages = rng.randint(1, 40)
        index = random_index(rng, num_pages, page_size)
        ix = RaggedIndexTensors.from_index(index)
        src = random_tensor((index.num_tokens, *feature), dtype, gen)
        start = random_tensor((num_pages, page_size, *feature), dtype, gen)
        got, want = start.clone(), start.clone()
        native.paged_scatter(got, src, *ix)
        reference.paged_scatter(want, src, ix)
        assert torch.equal(got, want)  # exact: both only move bytes
        assert torch.equal(native.paged_gather(got, *ix), reference.paged_gather(want, ix))
        assert torch.equal(native.paged_gather(got, *ix), src)  # a write then a read is the identity


def test_threads_split_long_requests(native):
    """Big enough that at::parallel_for splits the pages over threads; one request spans most of them."""
    gen = torch.Generator().manual_seed(0)
    alloc, page_size = PageAllocator(600, 16), 16
    a, b = PagedStream("a", page_size), PagedStream("b", page_size)
    plan_write([(a, 5)], alloc)
    index = plan_write([(a, 7000), (b, 333)], alloc)
    buffer = torch.zeros(600, page_size, 256)
    src = torch.randn(index.num_tokens, 256, generator=gen)
    want = buffer.clone()
    ops.paged_scatter(buffer, src, index)
    reference.paged_scatter(want, src, RaggedIndexTensors.from_index(index))
    assert torch.equal(buffer, want)
    read, _ = plan_read([(a, 5), (b, 100)], page_size)
    read2, _ = plan_read([(a, 7000), (b, 233)], page_size)
    assert torch.equal(ops.paged_gather(buffer, read2), torch.cat([src[:7000], src[7100:]]))
    assert torch.equal(ops.paged_gather(buffer, read)[5:], src[7000:7100])


def test_planned_stream_round_trip(native):
    """Chunks written and read with different chunkings come back in order, through the public ops."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    page_size, dim = 4, 6
    alloc = PageAllocator(64, page_size)
    buffer = torch.zeros(64, page_size, dim, dtype=torch.bfloat16)
    streams = [PagedStream(i, page_size, num_tokens=rng.randint(1, 40)) for i in range(4)]
    rows = {s.request_id: random_tensor((s.num_tokens, dim), torch.bfloat16, gen) for s in streams}
    out = {s.request_id: [] for s in streams}
    while not all(s.is_finished for s in streams):
        writes = [(s, min(rng.randint(0, 9), s.num_tokens - s.num_written_tokens)) for s in streams]
        index = plan_write(writes, alloc)
        ops.paged_scatter(buffer, torch.cat([rows[s.request_id][s.num_written_tokens - n:s.num_written_tokens]
                                             for s, n in writes]), index)
        reads = [(s, rng.randint(0, s.num_unread_tokens)) for s in streams]
        index, to_free = plan_read(reads, page_size)
        chunk = ops.paged_gather(buffer, index)
        for (s, n), start in zip(reads, index.pv_indptr):
            out[s.request_id].append(chunk[start:start + n])
        alloc.free(to_free)
    for s in streams:
        assert torch.equal(torch.cat(out[s.request_id]), rows[s.request_id])
    assert alloc.num_free_pages == alloc.num_pages


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_bad_input_raises_and_writes_nothing(native, impl):
    scatter = (lambda b, s, ix: native.paged_scatter(b, s, *ix)) if impl == "native" else reference.paged_scatter
    buffer = torch.zeros(4, 4, 3)
    good = RaggedIndexTensors.from_index(RaggedIndex.build([(3, 2, [1, 2])], 4))
    short = good._replace(pv_page_indices=torch.tensor([1]), pv_page_indptr=torch.tensor([0, 1]))
    out_of_range = good._replace(pv_page_indices=torch.tensor([1, 9]))
    for ix, src in [(short, torch.ones(3, 3)), (out_of_range, torch.ones(3, 3)), (good, torch.ones(2, 3)),
                    (good, torch.ones(3, 3, dtype=torch.float64)), (good, torch.ones(3, 4))]:
        with pytest.raises(RuntimeError):
            scatter(buffer, src, ix)
    assert not buffer.any()
    with pytest.raises(RuntimeError):
        scatter(buffer.transpose(0, 1), torch.ones(3, 3), good)


def test_kv_slot_scatter():
    cache = torch.zeros(10, 2, 4)
    src = torch.randn(3, 2, 4)
    ops.kv_slot_scatter(cache, src, torch.tensor([7, 0, 3]))
    assert torch.equal(cache[[7, 0, 3]], src) and cache[[1, 2, 4, 5, 6, 8, 9]].abs().sum() == 0


def test_no_native_env_forces_reference():
    code = ("import os, torch; from unifiedserve import ops; from unifiedserve.memory.pages import RaggedIndex\n"
            "ix = RaggedIndex.build([(3, 2, [1, 2])], 4); b = torch.zeros(4, 4, 2); s = torch.randn(3, 2)\n"
            "ops.paged_scatter(b, s, ix); assert torch.equal(ops.paged_gather(b, ix), s)\n"
            "assert not ops.native_available() and not hasattr(torch.ops.unifiedserve, 'paged_gather')\n"
            "print(ops.build_info()['reason'])")
    env = {**os.environ, "UNIFIEDSERVE_NO_NATIVE": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "UNIFIEDSERVE_NO_NATIVE" in run.stdout and run.stderr == ""


def test_failed_build_warns_once_and_falls_back(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this extension does not compile\n")
    monkeypatch.setattr(ops, "_SOURCES", [broken])
    monkeypatch.setattr(ops, "_CUDA_SOURCES", [])  # one build to fail, on a CUDA machine too
    monkeypatch.setattr(ops, "_EXTENSION_NAME", "unifiedserve_ops_broken_test")
    monkeypatch.setattr(ops, "_native", None)
    monkeypatch.setattr(ops, "_info", {})
    monkeypatch.setenv("UNIFIEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("UNIFIEDSERVE_NO_NATIVE", raising=False)
    index = RaggedIndex.build([(3, 2, [1, 2])], 4)
    buffer, src = torch.zeros(4, 4, 2), torch.randn(3, 2)
    with caplog.at_level(logging.WARNING, logger="unifiedserve.ops"):
        ops.paged_scatter(buffer, src, index)
        assert torch.equal(ops.paged_gather(buffer, index), src)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "using the torch reference" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    assert not ops.native_available() and ops.build_info()["reason"]
