"""bench/engine/step_trace: a decode step's device time outside its graph replay, read from a profiler trace."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "engine"))

import step_trace  # noqa: E402


def _x(cat, name, ts, dur, corr):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _trace(replays, between):
    """Graph launches at the given ``(start, kernels [(offset, dur)])`` and eager ops ``(cat, name, ts, dur)``."""
    events, corr = [], 100
    for start, kernels in replays:
        corr += 1
        events.append(_x("cuda_runtime", "cudaGraphLaunch", start - 50, 5, corr))
        events += [_x("kernel", f"graph_kernel_{i}", start + off, dur, corr) for i, (off, dur) in enumerate(kernels)]
    for i, (cat, name, ts, dur) in enumerate(between):
        events.append(_x("cuda_runtime", "cudaMemcpyAsync" if cat == "gpu_memcpy" else "cudaLaunchKernel",
                         ts - 20, 3, 1 + i))
        events.append(_x(cat, name, ts, dur, 1 + i))
    events.append({"ph": "i", "name": "marker", "ts": 0})  # not an "X" event: ignored
    return {"traceEvents": events}


def test_between_replays_ops_and_idle_are_split_per_step():
    kernels = [(0, 400), (410, 500), (920, 80)]  # busy 980 of a 1000-us replay
    replays = [(0, kernels), (1100, kernels), (2200, kernels)]
    between = [("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1010, 4), ("kernel", "argmax", 1030, 20),
               ("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 2110, 6), ("kernel", "argmax", 2130, 30),
               ("kernel", "before any replay", -500, 10)]  # not between two replays: not counted
    s = step_trace.summarize_steps(_trace(replays, between))
    assert s["replays"] == 3 and s["step_us"] == pytest.approx(1100)
    assert s["replay_us"] == pytest.approx(1000) and s["replay_busy_us"] == pytest.approx(980)
    assert s["between_us"] == pytest.approx(100) and s["between_busy_us"] == pytest.approx(30)
    assert s["between_idle_us"] == pytest.approx(70) and s["ops_between_per_step"] == pytest.approx(2)
    assert [(op["name"], op["per_step"], op["us"]) for op in s["between"]] == [
        ("argmax", 1, pytest.approx(25)), ("Memcpy HtoD (Pinned -> Device)", 1, pytest.approx(5))]
    line = step_trace.format_steps(s)
    assert line.startswith("step 1100.0 us = replay 1000.0 + between 100.0 (ops busy 30.0, idle 70.0, 2 ops)")
    assert "argmax 25.0 us x1" in line


def test_an_op_overlapping_a_replay_counts_only_its_part_between():
    kernels = [(0, 100)]
    s = step_trace.summarize_steps(_trace([(0, kernels), (200, kernels)], [("kernel", "late", 150, 100)]))
    assert s["between_busy_us"] == pytest.approx(50) and s["between"][0]["us"] == pytest.approx(50)


def test_fewer_than_two_replays_is_an_error_not_a_number():
    assert "error" in step_trace.summarize_steps(_trace([(0, [(0, 10)])], []))
    assert "error" in step_trace.summarize_steps({"traceEvents": []})
    assert step_trace.format_steps({"error": "x"}) == "x"


def test_profile_steps_needs_cuda_and_two_steps():
    with pytest.raises(ValueError, match="CUDA device"):
        step_trace.profile_steps(lambda: None, torch.device("cpu"))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="steps must be >= 2"):
            step_trace.profile_steps(lambda: None, torch.device("cuda"), steps=1)


@pytest.mark.cuda
def test_profile_steps_reads_a_real_graph_replay_and_the_ops_around_it():
    device = torch.device("cuda")
    x = torch.randn(256, 256, device=device)
    static = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static.copy_(x @ x)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static.copy_(torch.relu(x @ x))
    host = torch.arange(8).pin_memory()
    buf = torch.zeros(8, dtype=torch.int64, device=device)

    def step():
        buf.copy_(host, non_blocking=True)  # one copy and one kernel outside the graph
        graph.replay()
        static.argmax()

    s = step_trace.profile_steps(step, device, steps=6)
    assert "error" not in s, s
    assert s["replays"] == 6 and s["replay_busy_us"] > 0
    cats = {op["cat"] for op in s["between"]}
    assert {"gpu_memcpy", "kernel"} <= cats and s["ops_between_per_step"] >= 2


@pytest.mark.cuda
def test_profile_steps_on_the_engines_async_graph_steps(tmp_path, capsys):
    """The engine's own async decode steps (demo model, graphs): replays found, and the operations between them
    listed (printed for the device log: the tiny model's count is the mechanism's, not the 7B's figure)."""
    import decode_overhead

    from unifiedserve.engine.llm import LLM, EngineConfig
    from unifiedserve.model.demo import write_demo_model

    write_demo_model(tmp_path)
    engine = LLM(tmp_path, EngineConfig(device="cuda", num_kv_blocks=256, max_cuda_graph_batch=4))
    assert engine.runner.graphs is not None
    s = decode_overhead._trace_async_steps(engine, [[11, 12, 13, 14]] * 2, 14, 6, torch.device("cuda"))
    if s.get("error", "").startswith("the profiler failed"):
        pytest.skip(s["error"])  # the machine refuses CUPTI: a platform fact, said in the skip reason
    assert "error" not in s, s
    assert s["replays"] >= 5 and s["ops_between_per_step"] >= 1 and s["between"]
    with capsys.disabled():
        print("\nengine async steps (demo model, batch 2):", step_trace.format_steps(s, top=12))
