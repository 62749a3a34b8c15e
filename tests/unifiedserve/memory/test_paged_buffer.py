"""PagedBuffer over the planners."""

from __future__ import annotations

import pytest
import torch

from unifiedserve.memory import PageAllocator, PagedBuffer, PagedStream, plan_read, plan_write


def test_write_then_read_in_chunks():
    buffer = PagedBuffer(num_pages=8, page_size=4, dim=1176, dtype=torch.bfloat16)
    alloc = PageAllocator(8, 4)
    stream = PagedStream("video", 4, num_tokens=21)
    rows = torch.randn(21, 1176).to(torch.bfloat16)  # patch rows
    for start, stop in [(0, 5), (5, 6), (6, 21)]:
        buffer.write(rows[start:stop], plan_write([(stream, stop - start)], alloc))
    got = []
    for n in [3, 10, 8]:
        index, to_free = plan_read([(stream, n)], 4)
        got.append(buffer.read(index))
        alloc.free(to_free)
    assert torch.equal(torch.cat(got), rows)
    assert alloc.num_free_pages == 8


def test_storage_is_wrapped_not_copied_and_checked():
    storage = torch.zeros(3, 2, 5).share_memory_()  # as the runtime's pools are: shared, wrapped
    buffer = PagedBuffer(3, 2, 5, storage=storage)
    assert buffer.tensor.data_ptr() == storage.data_ptr() and buffer.num_bytes == 3 * 2 * 5 * 4
    with pytest.raises(ValueError, match="storage"):
        PagedBuffer(3, 2, 6, storage=storage)
    with pytest.raises(ValueError, match="page_size"):
        buffer.read(plan_read([], page_size=4)[0])
    assert PagedBuffer.num_pages_for_budget(2**20, page_size=16, dim=256, dtype=torch.bfloat16) == 128


def test_device_and_dtype_follow_the_arguments_or_the_storage():
    meta = PagedBuffer(4, 2, 3, dtype=torch.bfloat16, device="meta")  # allocated on the asked-for device
    assert meta.device.type == "meta" and meta.dtype == torch.bfloat16
    default = PagedBuffer(4, 2, 3)
    assert default.device == torch.device("cpu") and default.dtype == torch.float32
    storage = torch.zeros(4, 2, 3, dtype=torch.float16).share_memory_()
    wrapped = PagedBuffer(4, 2, 3, storage=storage)  # dtype and device from the storage
    assert wrapped.dtype == torch.float16 and wrapped.device.type == "cpu" and wrapped.tensor.is_shared()
    assert PagedBuffer(4, 2, 3, dtype=torch.float16, device="cpu", storage=storage).tensor is storage
    with pytest.raises(ValueError, match="dtype"):
        PagedBuffer(4, 2, 3, dtype=torch.float32, storage=storage)
    with pytest.raises(ValueError, match="device"):
        PagedBuffer(4, 2, 3, device="meta", storage=storage)
    with pytest.raises(ValueError, match="device must be"):
        PagedBuffer(4, 2, 3, device="gpu0")


def test_write_rejects_rows_of_another_dtype_or_device():
    buffer = PagedBuffer(8, 4, 6)
    index = plan_write([(PagedStream("s", 4), 5)], PageAllocator(8, 4))
    with pytest.raises(ValueError, match="src is torch.float64"):
        buffer.write(torch.ones(5, 6, dtype=torch.float64), index)
    with pytest.raises(ValueError, match="on meta"):
        buffer.write(torch.ones(5, 6, device="meta"), index)
    assert not buffer.tensor.any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="cuda"):
        PagedBuffer(4, 2, 3, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_buffer_on_cuda_round_trips(dtype):
    buffer = PagedBuffer(16, 4, 1176, dtype=dtype, device="cuda")
    assert buffer.tensor.is_cuda
    alloc, stream = PageAllocator(16, 4), PagedStream("video", 4, num_tokens=21)
    rows = torch.randn(21, 1176, generator=torch.Generator().manual_seed(0)).to(dtype).cuda()
    for start, stop in [(0, 5), (5, 6), (6, 21)]:
        buffer.write(rows[start:stop], plan_write([(stream, stop - start)], alloc))
    index, _ = plan_read([(stream, 21)], 4)
    got = buffer.read(index)
    assert got.is_cuda and torch.equal(got, rows)


