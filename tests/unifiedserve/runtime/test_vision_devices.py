"""Where the vision process decodes (``runtime/vision_devices.py``): its video decoders and its images' nvJPEG
follow the patch buffer's device, and its start-up line names them."""

from __future__ import annotations

import pytest
import torch

from unifiedserve.engine.config import EngineConfig
from unifiedserve.runtime.config import RuntimeConfig
from unifiedserve.runtime.shm import create_cpu_pool
from unifiedserve.runtime.vision_devices import decode_devices, describe_decoders
from vision_helpers import NUM_PAGES, PAGE_SIZE, RecordingVision


def test_decoders_follow_the_patch_buffer(tmp_path, demo_model):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert [decode_devices(v, cpu) for v in ("auto", "cpu")] == ["cpu", "cpu"]
    assert [decode_devices(v, gpu) for v in ("auto", "cpu", "cuda")] == ["auto", "cpu", "cuda"]
    with pytest.raises(ValueError, match="needs the patch buffer on a GPU"):
        decode_devices("cuda", cpu)
    spec = create_cpu_pool(str(tmp_path), "d", "patch", (NUM_PAGES, PAGE_SIZE, 1176), torch.float32)
    config = RuntimeConfig(model=demo_model, served_model_name="demo", ipc_dir=str(tmp_path), instance="d",
                           engine=EngineConfig(page_size=PAGE_SIZE, num_patch_pages=NUM_PAGES), pools={"patch": spec},
                           vision_threads=2)
    worker = RecordingVision(config)
    worker.sent = []
    info = worker.setup()
    try:  # a CPU server: the CPU decoders only, frames and patches on the CPU
        assert not worker.engine.layout.gpus and worker.engine.output_device == cpu
        assert info["decoder"] == describe_decoders(worker.engine)
        assert info["decoder"].endswith("x 2 threads, output on cpu") and "nvdec" not in info["decoder"]
        # the paged write's op is loaded at start-up, not by the first request's first write
        from unifiedserve import ops

        native = ops.build_info()["native"]
        assert info["patch_write"].startswith("native (" if native else "torch reference (")
    finally:
        worker.close()


def test_images_decode_on_a_gpu_where_videos_would(monkeypatch, caplog):
    import logging

    import flashcodec.devices as devices
    from unifiedserve.runtime.vision_devices import image_decode_gpu

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    asked = []
    works = lambda index: asked.append(index)  # noqa: E731  (None: nvJPEG works there)
    broken = lambda index: "torchvision is not installed"  # noqa: E731
    assert [image_decode_gpu(v, cpu, works) for v in ("auto", "cpu")] == [None, None]
    with pytest.raises(ValueError, match="needs the patch buffer on a GPU"):
        image_decode_gpu("cuda", cpu, works)
    assert asked == []  # nothing is probed for a CPU server
    assert [image_decode_gpu(v, gpu, works) for v in ("auto", "cuda", "cpu")] == [gpu, gpu, None]
    assert image_decode_gpu("auto", torch.device("cuda"), works) == gpu and asked == [0, 0, 0]
    monkeypatch.setattr(devices, "_logged", set())
    with caplog.at_level(logging.INFO, logger="flashcodec.devices"):
        assert image_decode_gpu("auto", gpu, broken) is None and image_decode_gpu("auto", gpu, broken) is None
    lines = [r.getMessage() for r in caplog.records if "nvJPEG is not usable" in r.getMessage()]
    assert len(lines) == 1 and "decodes images on the CPU" in lines[0] and "torchvision is not installed" in lines[0]
    with caplog.at_level(logging.INFO, logger="flashcodec.devices"):  # "cuda" is about NVDEC: images fall back too
        assert image_decode_gpu("cuda", gpu, broken) is None
    warned = [r for r in caplog.records if "vision_device cuda decodes images on the CPU" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
