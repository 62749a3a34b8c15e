"""memory.transfer.to_device: host values go up queued; tensors already on the target device stay as they are."""

from __future__ import annotations

import pytest
import torch

from unifiedserve.memory.transfer import to_device


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
