"""GPU placement per policy: SM shares, GPU mapping, and one clear error for each mistake."""

from __future__ import annotations

import pytest

from unifiedserve.runtime.gpu_placement import plan_gpu_placement


@pytest.fixture(autouse=True)
def _no_parent_gpu_list(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the ordinals below are the machine's own


def test_a_parent_gpu_list_is_translated_for_the_workers(monkeypatch):
    """A server started with CUDA_VISIBLE_DEVICES=2,5 sees those as its GPUs 0 and 1 (and allocates its pools
    there): its workers must get the same physical GPU, not the ordinal."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    p = plan_gpu_placement("unified", 2, gpus=[1])
    assert {n: p.env(n)["CUDA_VISIBLE_DEVICES"] for n in p.processes} == {"vision": "5", "core": "5", "decode": "5"}
    uuid = "GPU-8e3c1a2b-0000-4000-8000-000000000001"
    assert plan_gpu_placement("unified", 1).env("core", visible=f"{uuid}")["CUDA_VISIBLE_DEVICES"] == uuid


def test_unified_caps_everyone_but_decode():
    p = plan_gpu_placement("unified", num_visible_gpus=1, decode_sm_percent=30)
    assert p.env("decode") == {"CUDA_VISIBLE_DEVICES": "0"}
    for name in ("vision", "core"):
        assert p.env(name) == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70"}
    assert p.notes == ()


def test_unified_with_a_share_of_0_caps_nobody_and_says_what_keeps_decodes_pace():
    """The paper's configuration: every process on every SM, decode's TBT regulated by core's token budgets."""
    p = plan_gpu_placement("unified", num_visible_gpus=1, decode_sm_percent=0)
    assert all(p.env(n) == {"CUDA_VISIBLE_DEVICES": "0"} for n in ("vision", "core", "decode"))
    assert len(p.notes) == 1 and "token budgets" in p.notes[0]


def test_unified_without_mps_time_slices_and_says_so():
    p = plan_gpu_placement("unified", num_visible_gpus=1, use_mps=False)
    assert all("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in p.env(n) for n in ("vision", "core", "decode"))
    assert len(p.notes) == 1 and "time-slice" in p.notes[0]


def test_split_one_gpu_disjoint_shares_and_two_gpus_uncapped():
    p = plan_gpu_placement("split", num_visible_gpus=1, decode_sm_percent=40)
    assert p.processes["core"].sm_percent + p.processes["decode"].sm_percent == 100
    assert {pl.gpu for pl in p.processes.values()} == {0}
    two = plan_gpu_placement("split", num_visible_gpus=4, gpus=[2, 3])
    assert two.env("core") == {"CUDA_VISIBLE_DEVICES": "2"} and two.env("decode") == {"CUDA_VISIBLE_DEVICES": "3"}
    # by default one GPU, however many there are: the server cannot move the KV cache between GPUs yet
    assert {pl.gpu for pl in plan_gpu_placement("split", num_visible_gpus=2).processes.values()} == {0}


def test_mps_priority_puts_decode_first_and_keeps_the_caps():
    """--mps-priority: vision and core below-normal MPS clients, decode normal, beside each policy's caps (none at
    --decode-sm-percent 0: the paper's sharing)."""
    free = plan_gpu_placement("unified", 1, decode_sm_percent=0, mps_priority=True)
    assert free.env("core") == free.env("vision") == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_CLIENT_PRIORITY": "1"}
    assert free.env("decode") == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_CLIENT_PRIORITY": "0"}
    assert any("--mps-priority" in n for n in free.notes)
    capped = plan_gpu_placement("unified", 1, decode_sm_percent=30, mps_priority=True)
    assert capped.env("core") == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70",
                                  "CUDA_MPS_CLIENT_PRIORITY": "1"}
    split = plan_gpu_placement("split", 1, decode_sm_percent=30, mps_priority=True)
    assert split.env("decode")["CUDA_MPS_CLIENT_PRIORITY"] == "0" and \
        split.env("core")["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    plain = plan_gpu_placement("unified", 1)
    assert all("CUDA_MPS_CLIENT_PRIORITY" not in plain.env(n) for n in plain.processes)


def test_monolithic_has_no_decode_process():
    p = plan_gpu_placement("monolithic", num_visible_gpus=2, gpus=[1])
    assert set(p.processes) == {"vision", "core"} and p.env("core") == {"CUDA_VISIBLE_DEVICES": "1"}


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="bogus", num_visible_gpus=1), "--policy must be one of"),
    (dict(policy="unified", num_visible_gpus=0), "no CUDA device"),
    (dict(policy="unified", num_visible_gpus=1, decode_sm_percent=-1), "--decode-sm-percent"),
    (dict(policy="split", num_visible_gpus=1, decode_sm_percent=0), "applies to --policy unified"),
    (dict(policy="unified", num_visible_gpus=1, decode_sm_percent=100), "--decode-sm-percent"),
    (dict(policy="unified", num_visible_gpus=1, decode_sm_percent=12.5), "--decode-sm-percent"),
    (dict(policy="unified", num_visible_gpus=2, gpus=[2]), "GPU 2 is not visible"),
    (dict(policy="split", num_visible_gpus=2, gpus=[1, 1]), "names a GPU twice"),
    (dict(policy="unified", num_visible_gpus=2, gpus=[0, 1]), "one GPU per server"),
    (dict(policy="split", num_visible_gpus=4, gpus=[0, 1, 2]), "two GPUs per server"),
    (dict(policy="split", num_visible_gpus=1, use_mps=False), "needs MPS"),
    (dict(policy="unified", num_visible_gpus=1, gpus=[]), "--gpus is empty"),
    (dict(policy="monolithic", num_visible_gpus=1, mps_priority=True), "no decode process to put first"),
    (dict(policy="unified", num_visible_gpus=1, use_mps=False, mps_priority=True),
     "--mps-priority needs the server to run under MPS"),
])
def test_mistakes_get_one_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        plan_gpu_placement(**kwargs)
    assert "\n" not in str(err.value)
