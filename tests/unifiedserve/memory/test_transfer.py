"""memory.transfer: host values go up queued (to_device; write_to into a fixed buffer in one copy); tensors already
on the target device stay as they are."""

from __future__ import annotations

import pytest
import torch

from unifiedserve.memory.transfer import to_device, write_to


def test_the_cpu_is_a_no_op():
    t = torch.arange(4)
    assert to_device(t, torch.device("cpu")) is t
    assert to_device(t, "cpu") is t


def test_a_tensor_already_on_the_device_is_not_staged_through_the_host():
    # The device once saw this fail: patches decoded onto the GPU reached the runner, and to_device tried to pin
    # them ("cannot pin 'torch.cuda.FloatTensor'"). A meta tensor stands for a device tensor here: pinning it fails.
    t = torch.empty(3, 4, device="meta")
    assert to_device(t, torch.device("meta")) is t
    assert to_device(t, "meta") is t


@pytest.mark.cuda
def test_on_cuda_host_values_arrive_and_device_values_stay():
    host = torch.arange(6).expand(2, -1)  # stride 0: staged contiguous
    up = to_device(host, torch.device("cuda"))
    assert up.is_cuda and torch.equal(up.cpu(), host)
    assert to_device(up, torch.device("cuda")) is up
    assert torch.equal(to_device(up, "cpu"), host)


def test_write_to_copies_host_values_into_the_given_tensor():
    dst = torch.zeros(2, 3, dtype=torch.int64)
    write_to(dst, torch.arange(6).view(2, 3))
    assert dst.tolist() == [[0, 1, 2], [3, 4, 5]]
    write_to(dst[1], torch.tensor([7.0, 8.0, 9.0]))  # converted to the destination's dtype
    assert dst.tolist() == [[0, 1, 2], [7, 8, 9]]
    with pytest.raises(ValueError, match="copies host tensors, got one on meta"):
        write_to(dst, torch.empty(2, 3, device="meta"))


@pytest.mark.cuda
def test_write_to_on_cuda_is_one_queued_copy_into_a_contiguous_buffer():
    buf = torch.zeros(4, 8, dtype=torch.int64, device="cuda")
    write_to(buf[:2], torch.arange(16).view(2, 8).expand(2, 8))
    assert buf.cpu()[:2].flatten().tolist() == list(range(16)) and not buf.cpu()[2:].any()
    with pytest.raises(ValueError, match="contiguous destination"):
        write_to(buf[:, :2], torch.zeros(4, 2, dtype=torch.int64))
