"""`unifiedserve serve` GPU flags: refused on the CPU, and mapped onto per-process GPU and MPS settings
(runtime/gpu_placement.py) on CUDA, which is computed here without a GPU."""

from __future__ import annotations

import argparse
import socket

import pytest

from unifiedserve.runtime.gpu_placement import mps_running
from unifiedserve.server.serve_flags import add_arguments
from unifiedserve.server.serve_setup import gpu_placement_fields


@pytest.fixture(autouse=True)
def _no_parent_gpu_list(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the ordinals below are the machine's own


def flags(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv, needle", [
    (["--gpus", "0"], "--gpus applies to CUDA only"),
    (["--decode-sm-percent", "40"], "--decode-sm-percent applies to CUDA only"),
    (["--mps", "on"], "--mps applies to CUDA only"),
    (["--mps-priority"], "--mps-priority applies to CUDA only"),
])
def test_gpu_flags_on_the_cpu_are_refused(argv, needle):
    with pytest.raises(ValueError, match=needle):
        gpu_placement_fields(flags(*argv), "cpu", 0, False)
    assert gpu_placement_fields(flags(), "cpu", 0, False) == {}  # the defaults say nothing on the CPU


def test_unified_on_one_gpu_under_mps_caps_vision_and_core_and_leaves_decode_free():
    fields = gpu_placement_fields(flags("--decode-sm-percent", "25"), "cuda", 2, True)
    assert fields["gpu"] == 0
    assert fields["process_env"] == {
        "vision": {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"},
        "core": {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"},
        "decode": {"CUDA_VISIBLE_DEVICES": "0"},
    }


def test_a_share_of_0_uncaps_unified_and_monolithic_refuses_a_share_it_would_ignore():
    env = gpu_placement_fields(flags("--decode-sm-percent", "0"), "cuda", 1, True)["process_env"]
    assert all("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in e for e in env.values())  # 0 is not the default's 30
    with pytest.raises(ValueError, match="monolithic has no decode process"):
        gpu_placement_fields(flags("--policy", "monolithic", "--decode-sm-percent", "30"), "cuda", 1, True)
    with pytest.raises(ValueError, match="applies to --policy unified"):
        gpu_placement_fields(flags("--policy", "split", "--decode-sm-percent", "0"), "cuda", 1, True)


def test_split_on_one_gpu_gets_disjoint_shares_and_device_picks_the_gpu():
    fields = gpu_placement_fields(flags("--policy", "split"), "cuda:1", 2, True)
    assert fields["gpu"] == 1
    env = fields["process_env"]
    assert {p: e["CUDA_VISIBLE_DEVICES"] for p, e in env.items()} == {"vision": "1", "core": "1", "decode": "1"}
    assert env["core"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
    assert env["decode"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"


def test_without_mps_nothing_is_capped_and_monolithic_has_no_decode_process(caplog):
    for argv, running in ((["--mps", "off"], True), ([], False)):
        env = gpu_placement_fields(flags(*argv), "cuda", 1, running)["process_env"]
        assert all("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in e for e in env.values())
    assert "decode's SM share is not guaranteed" in caplog.text  # said once per start
    assert set(gpu_placement_fields(flags("--policy", "monolithic"), "cuda", 1, True)["process_env"]) == {"vision",
                                                                                                          "core"}


@pytest.mark.parametrize("argv, device, visible, running, needle", [
    (["--gpus", "0"], "cuda:1", 2, True, "--device cuda:1 and --gpus 0 disagree"),
    (["--mps", "on"], "cuda", 1, False, "--mps on: no MPS daemon answers"),
    (["--policy", "split", "--gpus", "0,1"], "cuda", 2, True, "needs the KV cache moved between GPUs"),
    (["--policy", "split"], "cuda", 1, False, "--policy split on one GPU needs MPS"),
    (["--gpus", "3"], "cuda", 2, True, "GPU 3 is not visible"),
    (["--gpus", "0,1"], "cuda", 2, True, "--policy unified uses one GPU per server"),
    (["--decode-threads", "4"], "cuda", 1, True, "--decode-threads applies to the CPU only"),
])
def test_contradictions_name_the_flag(argv, device, visible, running, needle):
    with pytest.raises(ValueError, match=needle):
        gpu_placement_fields(flags(*argv), device, visible, running)


def test_mps_running_looks_for_the_control_socket(tmp_path, monkeypatch):
    assert not mps_running(str(tmp_path))
    (tmp_path / "control").write_text("")  # a plain file is not a daemon
    assert not mps_running(str(tmp_path))
    (tmp_path / "control").unlink()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "control"))
        assert mps_running(str(tmp_path))
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
        assert mps_running()


@pytest.mark.parametrize("argv, expected", [
    ([], 0.9),  # no KV size given: vLLM's default share
    (["--gpu-memory-utilization", "0.5"], 0.5),
    (["--kv-cache-gb", "4"], None), (["--num-kv-blocks", "64"], None),  # a fixed size: no profile
])
def test_a_cuda_server_sizes_its_kv_cache_by_utilization_unless_given_a_size(monkeypatch, demo_path, argv, expected):
    import torch

    from unifiedserve.runtime import memory_plan
    from unifiedserve.server import serve_setup

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("unifiedserve.runtime.gpu_placement.mps_running", lambda: False)
    monkeypatch.setattr("unifiedserve.engine.device.resolve_dtype", lambda dtype, device: "bfloat16")
    monkeypatch.setattr("unifiedserve.engine.device.resolve_device", lambda device: device)
    asked = []

    def profile(model, engine, pools, *, utilization, **kw):  # stands in for the profile process on the GPU
        asked.append(utilization)
        raise RuntimeError(f"profiled at {utilization}")

    monkeypatch.setattr(memory_plan, "size_server_kv", profile)
    try:  # the CPU builds a CUDA config without a GPU only as far as the first thing that needs one
        runtime = serve_setup.build_runtime(flags("--model", str(demo_path), *argv))
    except ValueError as e:
        assert expected is None or f"profiled at {expected}" in str(e)
    else:
        runtime.stop()  # nothing started: removes its socket folder
    assert asked == ([] if expected is None else [expected])


def test_a_cap_in_the_servers_environment_reaches_no_worker(monkeypatch, caplog):
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_CLIENT_PRIORITY set where the server starts are said once and
    dropped in every placed worker: monolithic's processes and unified's decode stay uncapped, the capped ones get
    their policy's share, and no process a priority it was not given."""
    import logging
    import os

    from unifiedserve.runtime.gpu_placement import apply_process_env

    # apply_process_env writes the real environment: every variable it touches is recorded here first, so that the
    # tests after this one find the environment as it was (monkeypatch restores only what it recorded)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40")
    monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "1")
    with caplog.at_level(logging.WARNING, logger="unifiedserve"):
        unified = gpu_placement_fields(flags(), "cuda", 1, True)["process_env"]
        mono = gpu_placement_fields(flags("--policy", "monolithic"), "cuda", 1, True)["process_env"]
    assert sum("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40 in the server's environment is not passed on" in r.getMessage()
               for r in caplog.records) == 2
    assert sum("CUDA_MPS_CLIENT_PRIORITY=1 in the server's environment" in r.getMessage() for r in caplog.records) == 2
    for env, want in ((unified["decode"], None), (unified["core"], "70"), (mono["core"], None),
                      (mono["vision"], None)):
        monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40")
        monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "1")
        apply_process_env(env)  # as worker_main does, in the worker before CUDA starts
        assert os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == want
        assert "CUDA_MPS_CLIENT_PRIORITY" not in os.environ
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40")
    apply_process_env({})  # no placement (the CPU server): the environment is left as it is
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"


def test_mps_priority_flag_reaches_each_workers_environment():
    env = gpu_placement_fields(flags("--decode-sm-percent", "0", "--mps-priority"), "cuda", 1, True)["process_env"]
    assert env["decode"] == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_CLIENT_PRIORITY": "0"}
    assert env["core"] == env["vision"] == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_CLIENT_PRIORITY": "1"}
    for argv, running, needle in ((["--policy", "monolithic", "--mps-priority"], True, "no decode process"),
                                  (["--mps-priority"], False, "--mps-priority needs the server to run under MPS")):
        with pytest.raises(ValueError, match=needle):
            gpu_placement_fields(flags(*argv), "cuda", 1, running)
