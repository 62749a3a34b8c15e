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


def test_the_warm_up_runs_both_gpu_kernels_in_every_layout_a_decode_gives_them(monkeypatch, clips):
    """Triton compiles each kernel once per layout of the frames' rows (dense or not): the start-up warm-up must
    run the layouts a request's decode hands them, or the first request compiles on its path (the H100 server's
    first video did, 2026-11-27). NVDEC's frames are torchcodec's NCHW, a channels-last view, and FlashCodec's
    outputs are channels-last too; both are checked here on the CPU (torchcodec's CPU frames, a CPU decode)."""
    import flashcodec
    import flashcodec.patches as patches
    import flashcodec.resize as resize
    from flashcodec.patches import PatchSpec
    from torchcodec.decoders import VideoDecoder

    from unifiedserve.runtime.vision_devices import warm_gpu_kernels

    layouts = {"torchcodec NCHW": VideoDecoder(clips[0].path, dimension_order="NCHW").get_frames_at([0, 1]).data,
               "FlashCodec frames": flashcodec.decode_video(clips[0].path, num_frames=4).frames}
    assert {name: f.stride(3) == 1 for name, f in layouts.items()} == dict.fromkeys(layouts, False)
    seen = set()

    def fake_resize(frames, height, width):
        seen.add(("resize", frames.stride(3) == 1))
        return torch.zeros((frames.shape[0], 3, height, width), dtype=torch.uint8)

    monkeypatch.setattr(resize, "resize_frames_on_device", fake_resize)
    monkeypatch.setattr(patches, "frames_to_patches",
                        lambda frames, spec, dtype: seen.add(("patchify", frames.stride(3) == 1, dtype)))
    warm_gpu_kernels(PatchSpec(), torch.device("cpu"), torch.bfloat16)
    assert seen == {("resize", False), ("resize", True), ("patchify", False, torch.bfloat16),
                    ("patchify", True, torch.bfloat16)}


@pytest.mark.cuda
def test_cuda_after_the_warm_up_a_videos_nvdec_decode_compiles_nothing(clips):
    """The variants a video's decode on NVDEC launches (resize on the session's frames, patchify of the output)
    are all compiled by the warm-up: the first request pays no Triton compile (counted in Triton's own caches,
    which key on more than flashcodec's locks do: pointer alignment, integers divisible by 16)."""
    import flashcodec
    from flashcodec import patch_kernel, resize_kernel
    from flashcodec.patches import PatchSpec

    from unifiedserve.runtime.vision_devices import warm_gpu_kernels

    device = torch.device("cuda", 0)
    warm_gpu_kernels(PatchSpec(), device, torch.bfloat16)
    kernels = [module._kernel(False)[1] for module in (resize_kernel, patch_kernel)]
    if any(getattr(k, "device_caches", None) is None for k in kernels):
        pytest.skip("this Triton version keeps its compiled kernels elsewhere")

    def compiled():
        return [sum(len(cache[0]) for cache in k.device_caches.values()) for k in kernels]

    before = compiled()
    engine = flashcodec.DecodeEngine(devices=["cuda:0"], cpu_threads=0)
    try:
        for stream in (False, True):
            key = engine.analyse_bitstream(clips[0].path, max_pixels=128 * 96).key_id
            engine.add_decoding_request(key, output="patches", patch_dtype=torch.bfloat16, stream=stream)
            if stream:
                assert list(engine.stream_decoding_output(key))
            else:
                engine.get_decoding_output(key)
    finally:
        engine.close()
    assert compiled() == before
