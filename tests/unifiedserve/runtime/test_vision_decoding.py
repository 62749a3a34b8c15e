"""The vision process's probes and decodes (``runtime/vision_decoding.py``) in-process: a video is probed once
per media key, patches are made in the buffer's dtype, and a request's images are decoded as batches per pixel
budget (nvJPEG faked on the CPU), a bad one failing with its own index."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from flashcodec.image import decode_image
from unifiedserve.runtime import protocol
from vision_helpers import NUM_PAGES, PAGE_SIZE, SENTINEL, make_worker, messages, pump, reference_patches, \
    run_request, stream_rows


def test_a_video_is_probed_once_per_media_key(tmp_path, demo_model, clips, monkeypatch):
    import flashcodec.decode.engine as engine_module

    probed = []
    real = engine_module.probe
    monkeypatch.setattr(engine_module, "probe", lambda src, *cap: probed.append(src.name) or real(src, *cap))
    worker = make_worker(tmp_path, demo_model, streaming=False, delay_s=0.0)
    try:
        ref = protocol.MediaRef("video", path=clips[0].path, min_pixels=3136, max_pixels=128 * 96, key="k-a")
        plans = []
        for n, key in enumerate(["k-a", "k-a", "k-a2", ""]):
            media = [msgspec.structs.replace(ref, key=key)]
            rid = f"r{n}"
            worker.handle(protocol.ProbeMedia(rid, media))
            pump(worker, lambda: len(messages(worker, protocol.MediaProbed)) == n + 1)
            plans.append(messages(worker, protocol.MediaProbed)[-1].plans)
            worker.handle(protocol.CancelMedia(rid))
            pump(worker, lambda: rid not in worker.jobs and worker.in_flight == 0)
        # the same key: no second demux scan, the same plan; another key, or none, probes again
        assert len(probed) == 3 and plans[0] == plans[1] == plans[2] == plans[3]
        assert len(worker.probes) == 2  # "k-a" and "k-a2"; media without a key are not kept
    finally:
        worker.close()


def test_probe_cache_keeps_recent_probes_within_its_bytes():
    import numpy as np

    from unifiedserve.runtime.vision_decoding import ProbeCache

    class Info:
        def __init__(self, frames):
            self.frame_pts = self.decode_positions = np.zeros(frames, dtype=np.int64)
            self.keyframe_positions = np.zeros(1, dtype=np.int64)

    one = ProbeCache.size(Info(100))
    cache = ProbeCache(max_bytes=2 * one)
    a, b, c = Info(100), Info(100), Info(100)
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get("a") is a  # now the most recent
    cache.put("c", c)  # over the bound: the least recently used ("b") goes
    assert cache.get("b") is None and cache.get("a") is a and cache.get("c") is c and cache.bytes == 2 * one
    cache.put("", Info(1))  # no key: never kept
    cache.put("huge", Info(10_000))  # larger than the whole cache: not kept, nothing evicted for it
    assert len(cache) == 2 and cache.get("") is None and cache.get("huge") is None


def test_patches_are_made_in_the_buffers_dtype(tmp_path, demo_model, clips):
    """A bfloat16 pool gets bfloat16 patches from the decoder (no float32 copy of a whole video), each the
    float32 reference value rounded once, as the model's own cast would."""
    worker = make_worker(tmp_path, demo_model, streaming=False, dtype=torch.bfloat16)
    try:
        produced = []
        real = worker.engine.get_decoding_output
        worker.engine.get_decoding_output = lambda key: produced.append(real(key)) or produced[-1]
        pages = list(range(30))
        plans = run_request(worker, clips[:1], pages=pages)
        assert [d.patches.dtype for d in produced] == [torch.bfloat16]
        rows = plans[0].grid_thw[0] * plans[0].grid_thw[1] * plans[0].grid_thw[2]
        want = reference_patches(worker, clips[:1])[0].to(torch.bfloat16)
        assert torch.equal(stream_rows(worker, pages)[:rows], want)
    finally:
        worker.close()


# -- images decoded as a batch (the GPU branch; nvJPEG faked on the CPU) --------------------------------
class FakeNvjpeg:
    """A stand-in for the nvJPEG batch call: decodes with PIL on the CPU and records each call's JPEGs."""

    def __init__(self):
        self.calls: list[list[bytes]] = []

    def __call__(self, encoded, device):
        import io

        import numpy as np
        from PIL import Image

        assert device == torch.device("cuda", 0)
        self.calls.append([bytes(t.numpy()) for t in encoded])
        out = []
        for data in self.calls[-1]:
            with Image.open(io.BytesIO(data)) as im:  # stored orientation, as nvJPEG gives; raises on bad data
                out.append(torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).contiguous())
        return out


def batch_worker(tmp_path, model, fake):
    """A CPU worker whose images take the GPU branch: a batch decoder with a fake nvJPEG, results on the CPU."""
    from flashcodec.image_batch import ImageBatchDecoder

    worker = make_worker(tmp_path, model, streaming=False, delay_s=0.0)
    assert worker.image_decoder is None  # a CPU server decodes images one by one, as before
    worker.image_decoder = ImageBatchDecoder("cuda:0", jpeg_batch=fake, output_device="cpu", cpu_threads=2)
    return worker


def image_reference(worker, ref):
    """An image's patches as the one-by-one CPU path makes them (float32, on the CPU)."""
    min_pixels, max_pixels = worker._image_pixels(ref)
    source = ref.path if ref.path is not None else ref.data
    return decode_image(source, min_pixels=min_pixels, max_pixels=max_pixels).to_patches(worker.spec)[0]


def test_a_requests_images_decode_as_batches_per_pixel_budget(tmp_path, demo_model, clips, image_factory):
    """JPEGs of one pixel budget go to nvJPEG in one call, in input order; other images to the CPU threads;
    every media's patches land at its rows, sized as the one-by-one CPU path sizes them."""
    from flashcodec.patches import OPENAI_CLIP_STD

    small = dict(min_pixels=3136, max_pixels=56 * 56)
    jpegs = [image_factory(".jpg", width=w, height=h, seed=30 + n) for n, (w, h) in
             enumerate([(120, 90), (64, 200), (90, 60), (150, 110)])]
    media = [protocol.MediaRef("image", path=str(jpegs[0])), clips[0],
             protocol.MediaRef("image", path=str(jpegs[1]), **small), clips[1],  # a PNG
             protocol.MediaRef("image", data=jpegs[2].read_bytes()),
             protocol.MediaRef("image", path=str(jpegs[3]), **small)]
    fake = FakeNvjpeg()
    worker = batch_worker(tmp_path, demo_model, fake)
    try:
        started = time.time()
        pages = list(range(40))
        plans = run_request(worker, media, pages=pages)
        # two pixel budgets: two nvJPEG calls, each with its JPEGs in input order; the PNG never went there
        assert fake.calls == [[jpegs[0].read_bytes(), jpegs[2].read_bytes()],
                              [jpegs[1].read_bytes(), jpegs[3].read_bytes()]]
        expected = [image_reference(worker, m) if m.kind == "image" else reference_patches(worker, [m])[0]
                    for m in media]
        rows = [p.grid_thw[0] * p.grid_thw[1] * p.grid_thw[2] for p in plans]
        assert [e.shape[0] for e in expected] == rows  # each image sized by its own budget
        assert rows[2] < image_reference(worker, msgspec.structs.replace(media[2], min_pixels=None,
                                                                         max_pixels=None)).shape[0]
        written = stream_rows(worker, pages)
        level = 1.0 / 255 / min(OPENAI_CLIP_STD)  # one pixel level in patch units, at its largest
        offset = 0
        for index, (want, n) in enumerate(zip(expected, rows)):
            got = written[offset:offset + n]
            if index in (0, 2, 4, 5):  # "nvJPEG" + the GPU reference resize vs PIL's bicubic: rounded apart
                assert (got - want).abs().mean().item() <= level
            else:  # videos, and the PNG (CPU threads: decode_image itself)
                assert torch.equal(got, want)
            offset += n
        assert torch.all(written[offset:] == SENTINEL)
        ready = {m.media_index: m for m in messages(worker, protocol.MediaReady)}
        assert set(ready) == set(range(len(media)))
        for index in (0, 2, 3, 4, 5):
            assert ready[index].video_decode_s > 0 and started <= ready[index].decode_start <= time.time()
    finally:
        worker.close()


@pytest.mark.parametrize("bad_at", [1, 2, 3])
def test_a_bad_image_in_a_batch_fails_with_its_own_index(tmp_path, demo_model, image_factory, bad_at):
    """The failing image is named by its index, in the one-by-one path's words, even when its batch holds
    others and another budget's batch comes first; a later bad image does not hide an earlier one."""
    small = dict(min_pixels=3136, max_pixels=56 * 56)
    good = [protocol.MediaRef("image", path=str(image_factory(".jpg", width=80, height=60, seed=40 + n)),
                              **(small if n % 2 else {})) for n in range(4)]
    whole = image_factory(".jpg", width=80, height=60, seed=50).read_bytes()
    truncated = whole[:len(whole) // 2]  # its header reads: it goes to "nvJPEG", which fails on it
    media = list(good)
    media[bad_at] = protocol.MediaRef("image", data=truncated, **(small if bad_at % 2 else {}))
    media.append(protocol.MediaRef("image", data=b"not an image at all"))  # also bad, but later
    failures = []
    for fake in (FakeNvjpeg(), None):  # the batch branch, then the one-by-one CPU path
        ipc_dir = tmp_path / ("batch" if fake else "one-by-one")
        ipc_dir.mkdir()
        worker = batch_worker(ipc_dir, demo_model, fake) if fake else \
            make_worker(ipc_dir, demo_model, streaming=False, delay_s=0.0)
        try:
            worker.handle(protocol.ProbeMedia("r1", media))
            pump(worker, lambda: messages(worker, protocol.MediaFailed))
            failures.append(messages(worker, protocol.MediaFailed)[0].message)
            assert "r1" not in worker.jobs and not messages(worker, protocol.MediaProbed)
        finally:
            worker.close()
        if fake:  # the batch branch ran, and looked for the bad JPEG one by one
            assert fake.calls and (bad_at == 3 or [truncated] in fake.calls)
    assert failures[0] == failures[1] and failures[0].startswith(f"media {bad_at}: ")
    assert "truncated or corrupt" in failures[0]


@pytest.mark.parametrize("batched", [False, True])
def test_an_image_past_the_servers_source_cap_fails_before_its_pixels_are_decoded(tmp_path, demo_model, batched):
    """A tiny PNG whose header says 8000x6300 (50.4 M pixels, over the default --max-image-source-mp 50) fails from
    its header, in both decode paths: PIL's limit (179 M) let such files cost the vision process gigabytes. The cap
    is the server's setting (RuntimeConfig.max_image_source_pixels)."""
    import dataclasses

    from PIL import Image

    from unifiedserve.runtime.config import RuntimeConfig

    cap = RuntimeConfig.max_image_source_pixels
    wide, small = tmp_path / "wide.png", tmp_path / "small.png"
    Image.new("1", (8000, 6300)).save(wide)  # 1-bit, all black: a few KB
    Image.new("RGB", (80, 60)).save(small)
    assert wide.stat().st_size < 100_000 and 8000 * 6300 > cap == 50_000_000
    worker = batch_worker(tmp_path, demo_model, FakeNvjpeg()) if batched else \
        make_worker(tmp_path, demo_model, streaming=False, delay_s=0.0)

    def failure(request_id, path):
        worker.handle(protocol.ProbeMedia(request_id, [protocol.MediaRef("image", path=str(path))]))
        pump(worker, lambda: any(m.request_id == request_id for m in messages(worker, protocol.MediaFailed)))
        return next(m.message for m in messages(worker, protocol.MediaFailed) if m.request_id == request_id)

    try:
        message = failure("r1", wide)
        assert message.startswith("media 0: ") and "too large (8000x6300" in message, message
        assert f"the limit is {cap}" in message
        worker.config = dataclasses.replace(worker.config, max_image_source_pixels=4000)  # 80x60 is 4800
        assert "too large (80x60 = 4800 pixels, the limit is 4000)" in failure("r2", small)
    finally:
        worker.close()


@pytest.mark.cuda
def test_on_a_gpu_images_are_decoded_and_cut_there(tmp_path, demo_model, image_factory):
    """A CUDA server's images: JPEGs on nvJPEG (the PNG on CPU threads), patches cut on the GPU in the pool's
    bfloat16 and written GPU to GPU; the rows equal the CPU path's within a pixel level on average."""
    from flashcodec.image_batch import ImageBatchDecoder, nvjpeg_unavailable_reason
    from flashcodec.patches import OPENAI_CLIP_STD
    from unifiedserve.memory.buffers import PagedBuffer
    from unifiedserve.runtime.vision_devices import image_decode_gpu
    from unifiedserve.runtime.worker import pool_barrier

    device = torch.device("cuda", 0)
    if image_decode_gpu("auto", device) is None:
        pytest.skip(f"nvJPEG is not usable here: {nvjpeg_unavailable_reason(0)}")
    small = dict(min_pixels=3136, max_pixels=112 * 112)
    paths = [image_factory(suffix, width=w, height=h, seed=60 + n) for n, (suffix, w, h) in
             enumerate([(".jpg", 320, 240), (".png", 90, 60), (".jpg", 160, 256), (".jpg", 200, 150)])]  # 684 rows
    media = [protocol.MediaRef("image", path=str(p), **(small if n == 3 else {})) for n, p in enumerate(paths)]
    worker = make_worker(tmp_path, demo_model, streaming=False, delay_s=0.0)
    worker.patch_buffer = PagedBuffer(NUM_PAGES, PAGE_SIZE, 1176, dtype=torch.bfloat16, device=device)
    worker.patch_buffer.tensor.fill_(SENTINEL)
    worker._published = pool_barrier(device)
    worker.image_decoder = ImageBatchDecoder("cuda:0", cpu_threads=2, output_device=device)
    made = []  # every image the batch decoder returned
    decode = worker.image_decoder.decode
    worker.image_decoder.decode = lambda sources, **kw: made.extend(out := decode(sources, **kw)) or out
    try:
        pages = list(range(NUM_PAGES))
        plans = run_request(worker, media, pages=pages)
        assert made and all(image.pixels.device == device for image in made)
        rows = [p.grid_thw[0] * p.grid_thw[1] * p.grid_thw[2] for p in plans]
        written = stream_rows(worker, pages).float().cpu()
        level = 1.0 / 255 / min(OPENAI_CLIP_STD)
        offset = 0
        for ref, n in zip(media, rows):
            want = image_reference(worker, ref)
            assert want.shape[0] == n
            assert (written[offset:offset + n] - want).abs().mean().item() <= level
            offset += n
        assert torch.all(written[offset:] == SENTINEL)
    finally:
        worker.close()


def test_a_whole_decode_without_memory_for_it_is_a_503_that_names_no_figures(tmp_path, demo_model, clips, monkeypatch):
    """flashcodec refuses a whole output larger than the memory the process can still take: in the server that is
    the server's state, not the client's media (503, retry), and the message shows no host memory figures."""
    import flashcodec._sysmem

    worker = make_worker(tmp_path, demo_model, streaming=False, delay_s=0.0)
    try:
        ref = protocol.MediaRef("video", path=clips[0].path, min_pixels=3136, max_pixels=128 * 96, key="k")
        monkeypatch.setattr(flashcodec._sysmem, "available_memory", lambda: (1000, "available memory"))
        worker.handle(protocol.ProbeMedia("r1", [ref]))  # its decode starts ahead of admission, after the probe
        pump(worker, lambda: messages(worker, protocol.MediaFailed))
        failed = messages(worker, protocol.MediaFailed)[0]
        assert failed.status_code == 503 and "no memory for this video's decoded frames now" in failed.message
        assert "GiB" not in failed.message
        pump(worker, lambda: "r1" not in worker.jobs and worker.in_flight == 0)
        assert not worker.engine._analyses  # the refused request's analysis is not kept
    finally:
        worker.close()


@pytest.mark.parametrize("streaming", [True, False])
def test_decode_trace_logs_one_line_per_video_only_when_asked(tmp_path, demo_model, clips, monkeypatch, caplog,
                                                              streaming):
    """``UNIFIEDSERVE_DECODE_TRACE=1`` logs where each video's decode time went (first segment, each rank), and
    the rows written are the same as untraced; without it nothing is traced."""
    import logging

    pages = list(range(30))
    rows = {}
    for traced in (False, True):
        if traced:
            monkeypatch.setenv("UNIFIEDSERVE_DECODE_TRACE", "1")
        (tmp_path / str(traced)).mkdir()
        worker = make_worker(tmp_path / str(traced), demo_model, streaming=streaming)
        try:
            with caplog.at_level(logging.INFO, logger="unifiedserve"):
                caplog.clear()
                run_request(worker, clips[:1], pages=pages)
                lines = [r.getMessage() for r in caplog.records if "decode trace" in r.getMessage()]
            rows[traced] = stream_rows(worker, pages).clone()
        finally:
            worker.close()
        if not traced:
            assert lines == []
            continue
        assert len(lines) == 1, lines
        mode = "streamed" if streaming else "whole"
        assert f"media 0 ({mode}" in lines[0] and ("first part out at" in lines[0]) == streaming
        assert "first segment on cpu slot" in lines[0] and "cpu: " in lines[0] and "segments (" in lines[0]
    assert torch.equal(rows[False], rows[True])
