"""Workers' memory gauges (``unifiedserve_process_memory_bytes`` in /metrics)."""

import pytest
import torch

from unifiedserve.runtime.worker import device_memory_gauges, weight_gauges


def test_weights_split_into_own_and_shared_pool_bytes():
    pool = torch.zeros(64, dtype=torch.uint8)
    model = torch.nn.Linear(4, 2)  # 8 + 2 float32 parameters
    model.weight = torch.nn.Parameter(pool[:32].view(torch.float32).view(2, 4))  # a view of the pool
    assert weight_gauges(model, pool) == {"mem_weights_own_bytes": 8.0, "mem_weights_shared_bytes": 32.0}
    assert weight_gauges(model) == {"mem_weights_own_bytes": 40.0, "mem_weights_shared_bytes": 0.0}


def test_no_device_gauges_on_the_cpu():
    assert device_memory_gauges("cpu") == {}


@pytest.mark.cuda
def test_device_gauges_follow_torch_allocations():
    before = device_memory_gauges("cuda")["mem_device_allocated_bytes"]
    x = torch.empty(2**20, dtype=torch.uint8, device="cuda")
    after = device_memory_gauges("cuda")
    assert after["mem_device_allocated_bytes"] >= before + 2**20
    assert after["mem_device_peak_bytes"] >= after["mem_device_allocated_bytes"]
    del x
