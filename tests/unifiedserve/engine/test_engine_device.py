"""Device and dtype resolution, KV sizing arithmetic, CUDA-graph sizes, EngineConfig validation (CPU)."""

import pytest
import torch

from unifiedserve.engine.device import (DTYPE_CHOICES, graph_batch_sizes, kv_bytes_per_block, resolve_device,
                                        resolve_dtype, size_kv_pool)
from unifiedserve.engine.llm import EngineConfig
from unifiedserve.engine.profile import encode_grid

GiB = 2 ** 30


@pytest.mark.parametrize("name, cuda, count, expected", [
    ("auto", True, 1, "cuda"), ("auto", False, 0, "cpu"), ("cpu", True, 2, "cpu"), ("cuda", True, 1, "cuda"),
    ("cuda:1", True, 2, "cuda:1"),
])
def test_resolve_device(name, cuda, count, expected):
    assert resolve_device(name, cuda_available=cuda, device_count=count) == expected


@pytest.mark.parametrize("name, cuda, count, match", [
    ("gpu", True, 1, "auto, cpu, cuda, cuda:N"), ("cuda:", True, 1, "auto, cpu"), ("CUDA", True, 1, "auto"),
    ("cuda", False, 0, "no CUDA GPU"), ("cuda:0", False, 0, "no CUDA GPU"), ("cuda:2", True, 2, "sees 2 GPU"),
])
def test_resolve_device_errors(name, cuda, count, match):
    with pytest.raises(ValueError, match=match):
        resolve_device(name, cuda_available=cuda, device_count=count)


def test_resolve_dtype():
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float32", "cuda") == "float32"  # fp32 stays selectable on CUDA
    assert resolve_dtype("float16", "cpu") == "float16"
    with pytest.raises(ValueError, match=", ".join(DTYPE_CHOICES)):
        resolve_dtype("fp8", "cuda")


def test_engine_config_on_cpu():
    assert (EngineConfig().device, EngineConfig().dtype) == ("cpu", "float32")  # the default stays the CPU
    auto = EngineConfig(device="auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert auto.device == expected
    assert auto.dtype == ("bfloat16" if expected == "cuda" else "float32")
    cpu = EngineConfig(device="cpu")
    assert (cpu.device, cpu.dtype, cpu.num_kv_blocks, cpu.gpu_memory_utilization) == ("cpu", "float32", 1024, None)
    assert EngineConfig(device="cpu", num_kv_blocks=7).num_kv_blocks == 7
    with pytest.raises(ValueError, match="CUDA only"):
        EngineConfig(device="cpu", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="auto, cpu, cuda"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="auto, flashinfer, torch"):
        EngineConfig(device="cpu", attention="xformers")
    with pytest.raises(ValueError, match="num_kv_blocks"):
        EngineConfig(device="cpu", num_kv_blocks=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_engine_config_cuda_without_gpu():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        EngineConfig(device="cuda")


def test_kv_bytes_per_block():
    # Qwen2.5-VL-7B: 28 layers, 4 KV heads of 128, bf16, 16-token blocks -> 56 KiB per token
    assert kv_bytes_per_block(28, 16, 4, 128, torch.bfloat16) == 28 * 2 * 16 * 4 * 128 * 2


def test_size_kv_pool_arithmetic():
    per_block = kv_bytes_per_block(28, 16, 4, 128, torch.bfloat16)  # 896 KiB
    s = size_kv_pool(total=80 * GiB, utilization=0.9, weights=16 * GiB, activations=5 * GiB, other=GiB,
                     bytes_per_block=per_block)
    free = int(80 * GiB * 0.9) - 22 * GiB
    assert s.num_blocks == free // per_block and s.kv_bytes <= free < s.kv_bytes + per_block
    text = s.describe()
    for figure in ("80.00", "0.90", "16.00", "5.00", "1.00", f"{s.num_blocks} blocks"):
        assert figure in text
    assert size_kv_pool(100, 1.0, 10, 10, 0, 8).num_blocks == 10  # exact fit
    assert size_kv_pool(100, 1.0, 10, 10, 0, 7).num_blocks == 11  # rounds down


@pytest.mark.parametrize("kwargs, match", [
    (dict(utilization=0.0), r"\(0, 1\]"), (dict(utilization=1.2), r"\(0, 1\]"),
    (dict(weights=-1), "non-negative"), (dict(bytes_per_block=0), "positive"),
    (dict(weights=95), "no room for the KV cache"),
])
def test_size_kv_pool_errors(kwargs, match):
    args = dict(total=100, utilization=1.0, weights=10, activations=0, other=0, bytes_per_block=8) | kwargs
    with pytest.raises(ValueError, match=match):
        size_kv_pool(**args)


def test_graph_batch_sizes():
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 64)
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(200) == (1, 2, 4, 8, 16, 24, 32, 64, 128, 200)
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_encode_grid():
    for budget in (4, 100, 4096, 16384, 5000):
        t, h, w = encode_grid(budget, 2)
        assert t == 1 and h % 2 == 0 and w % 2 == 0 and h * w <= budget
        assert h * w >= budget // 2  # near the budget, not a token grid
    with pytest.raises(ValueError, match="merge window"):
        encode_grid(3, 2)


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "torch sees no CUDA GPU"), (["--device", "cuda:1"], "torch sees no CUDA GPU"),
    (["--device", "cpu", "--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization applies to a CUDA server"),
    (["--device", "cpu", "--decode-sm-percent", "40"], "--decode-sm-percent applies to CUDA only"),
])
def test_serve_refuses_cuda_flags_in_one_line_before_spawning(argv, message, capsys, monkeypatch):
    from unifiedserve import cli
    from unifiedserve.runtime import launcher

    monkeypatch.setattr(launcher.Runtime, "start", lambda self: pytest.fail("a worker was spawned"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    assert cli.main(["serve", *argv, "--model", "/nonexistent"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("unifiedserve: error: ") and message in err[0]


def test_serve_device_flag_values(capsys):
    from unifiedserve import cli

    args = cli.build_parser().parse_args(["serve", "--device", "cuda:3", "--enforce-eager"])
    assert args.device == "cuda:3" and args.enforce_eager and args.gpu_memory_utilization is None
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--device", "gpu"])
    assert "auto, cpu, cuda, cuda:N" in capsys.readouterr().err
