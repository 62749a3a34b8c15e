"""Per-policy CPU placement: split partitions the cores, unified shares them with decode first."""

from __future__ import annotations

import pytest

from unifiedserve.runtime.launcher import UNIFIED_NICE, cpu_placement


def test_split_partitions_cores_in_halves():
    p = cpu_placement("split", list(range(8)))
    assert p["cpu_affinity"] == {"vision": [0, 1, 2, 3], "core": [0, 1, 2, 3], "decode": [4, 5, 6, 7]}
    assert p["torch_threads"] == {"core": 4, "decode": 4}
    assert p["vision_threads"] == 4
    one = cpu_placement("split", [3])  # one core: both halves are that core
    assert one["cpu_affinity"]["core"] == one["cpu_affinity"]["decode"] == [3]


@pytest.mark.parametrize("n, decode", [(1, 1), (2, 1), (8, 2), (16, 4)])
def test_unified_shares_every_core_and_favours_decode(n, decode):
    p = cpu_placement("unified", list(range(n)))
    assert "cpu_affinity" not in p  # no partition: every process may run on every core
    assert p["torch_threads"] == {"core": n, "decode": decode}
    assert p["core_threads_shared"] == max(1, n - decode)
    assert p["nice"] == {"vision": UNIFIED_NICE, "core": UNIFIED_NICE}  # decode keeps normal priority


def test_unified_decode_threads_flag_and_monolithic_default():
    p = cpu_placement("unified", list(range(8)), decode_threads=3)
    assert p["torch_threads"]["decode"] == 3 and p["core_threads_shared"] == 5
    assert cpu_placement("unified", [0, 1], decode_threads=9)["torch_threads"]["decode"] == 2  # capped at the cores
    assert cpu_placement("monolithic", list(range(8))) == {}
    with pytest.raises(ValueError, match="decode-threads"):
        cpu_placement("unified", [0, 1], decode_threads=-1)
    for policy in ("split", "monolithic"):  # a flag the policy would ignore is refused
        with pytest.raises(ValueError, match="--decode-threads applies to --policy unified only"):
            cpu_placement(policy, list(range(8)), decode_threads=2)
