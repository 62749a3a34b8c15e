"""CPU pools: one memory seen by several processes, gone from the file system once unlinked."""

import multiprocessing as mp
import os

import pytest
import torch

from unifiedserve.runtime.shm import check_shm_space, create_cpu_pool, open_pool, unlink_pool


def _child_writes(spec, value):
    t = open_pool(spec)
    t[1].fill_(value)


def test_pool_is_shared_across_processes_and_survives_unlink(tmp_path):
    spec = create_cpu_pool(str(tmp_path), "unifiedserve-test", "kv", (3, 4, 5), torch.float32)
    mine = open_pool(spec)
    assert mine.shape == (3, 4, 5) and float(mine.abs().sum()) == 0
    proc = mp.get_context("spawn").Process(target=_child_writes, args=(spec, 7.0))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert torch.all(mine[1] == 7) and torch.all(mine[0] == 0) and torch.all(mine[2] == 0)
    unlink_pool(spec)
    assert not os.path.exists(spec.path)
    mine[2].fill_(3.0)  # the mapping outlives the file
    assert float(mine[2].sum()) == 60
    unlink_pool(spec)  # twice is fine


def test_bfloat16_pool(tmp_path):
    spec = create_cpu_pool(str(tmp_path), "t", "patch", (2, 8), torch.bfloat16)
    assert spec.num_bytes == 32 and os.path.getsize(spec.path) == 32
    assert open_pool(spec).dtype == torch.bfloat16


def test_not_enough_shared_memory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--shm-dir"):
        check_shm_space(str(tmp_path), 2**62)


def test_pools_over_the_memory_cgroups_room_are_a_clear_error(tmp_path):
    """tmpfs pages count against the memory cgroup: pools the folder could hold but the container's limit could
    not are refused at start-up, not met by the OOM killer while serving."""
    with pytest.raises(ValueError, match=r"need 2\.00 GiB but this process's memory limit \(cgroup\) leaves 1\.00 GiB"
                                         r".*--kv-cache-gb.*--memory"):
        check_shm_space(str(tmp_path), 2**31, cgroup_room=2**30)
    check_shm_space(str(tmp_path), 2**29, cgroup_room=2**30)
    check_shm_space(str(tmp_path), 2**29, cgroup_room=None)  # no limit
    check_shm_space(str(tmp_path), 2**20)  # this machine's own cgroups, read
