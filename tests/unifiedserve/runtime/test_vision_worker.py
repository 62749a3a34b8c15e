"""The vision process in-process: patches land at their rows of the request's pages, streamed slice by
slice or whole, and media core already has (``skip_media``) are neither decoded to the end nor written."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from flashcodec import DecodeEngine
from flashcodec.image import decode_image
from slow_decoding import SlowBackend
from unifiedserve.model.demo import write_demo_model
from unifiedserve.runtime import protocol
from unifiedserve.engine.config import EngineConfig
from unifiedserve.runtime.config import RuntimeConfig
from unifiedserve.runtime.shm import create_cpu_pool
from unifiedserve.runtime.vision_devices import decode_devices, describe_decoders
from unifiedserve.runtime.vision_worker import VisionWorker

PAGE_SIZE = 16  # small pages: slices and media cross page boundaries
NUM_PAGES = 64
SENTINEL = -7.0  # what rows nobody wrote hold


class RecordingVision(VisionWorker):
    """The vision worker with its outgoing messages recorded instead of sent."""

    def send(self, peer, message):
        self.sent.append((peer, message))


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    return str(write_demo_model(tmp_path_factory.mktemp("demo"), seed=1))


@pytest.fixture(scope="module")
def clips(video_factory, image_factory):
    """Two videos of several GOPs (8 and 4 sampled frames at 2 fps) and an image."""
    a = video_factory(codec="h264", bframes=2, suffix=".mp4", width=128, height=96, duration_s=4.0, fps=24.0,
                      gop=12, seed=21)
    b = video_factory(codec="h264", suffix=".mp4", width=96, height=64, duration_s=2.0, fps=24.0, gop=6, seed=22)
    image = image_factory(".png", width=90, height=60, seed=23)
    small = dict(min_pixels=3136, max_pixels=128 * 96)  # frames at about their own size, not upscaled
    return [protocol.MediaRef("video", path=str(a), **small), protocol.MediaRef("image", path=str(image)),
            protocol.MediaRef("video", path=str(b), **small)]


def make_worker(tmp_path, model, streaming: bool, delay_s: float = 0.06, dtype: torch.dtype = torch.float32):
    spec = create_cpu_pool(str(tmp_path), "t", "patch", (NUM_PAGES, PAGE_SIZE, 1176), dtype)
    config = RuntimeConfig(model=model, served_model_name="demo", ipc_dir=str(tmp_path), instance="t",
                           engine=EngineConfig(page_size=PAGE_SIZE, num_patch_pages=NUM_PAGES), pools={"patch": spec},
                           streaming_ingest=streaming, vision_threads=2)
    worker = RecordingVision(config)
    worker.sent = []
    worker.setup()
    worker.engine.close()
    worker.engine = DecodeEngine(SlowBackend(delay_s), 2)
    worker.patch_buffer.tensor.fill_(SENTINEL)
    return worker


def pump(worker, until, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "the vision worker did not get there in time"
        if worker.has_work():
            worker.step()
        else:
            time.sleep(0.002)


def reference_patches(worker, media):
    out = []
    with DecodeEngine("pyav", 1) as engine:
        for ref in media:
            if ref.kind == "image":
                image = decode_image(ref.path, min_pixels=worker.image_pixels[0], max_pixels=worker.image_pixels[1])
                out.append(image.to_patches(worker.spec)[0])
            else:
                out.append(engine.decode_video(ref.path, output="patches", patch_spec=worker.spec,
                                               min_pixels=ref.min_pixels, max_pixels=ref.max_pixels).patches)
    return out


def stream_rows(worker, pages):
    """The request's patch stream: its pages' rows, in page-list order."""
    return worker.patch_buffer.tensor[pages].reshape(-1, worker.patch_buffer.tensor.shape[-1])


def messages(worker, kind):
    return [m for _, m in worker.sent if isinstance(m, kind)]


def run_request(worker, media, *, pages, skip=(), write_after_first_part=True):
    worker.handle(protocol.ProbeMedia("r1", media))
    pump(worker, lambda: messages(worker, protocol.MediaProbed))
    job = worker.jobs["r1"]
    if write_after_first_part and worker.config.streaming_ingest:  # slices decoded before the pages come
        pump(worker, lambda: job.rows_decoded)
    worker.handle(protocol.WritePatches("r1", pages, list(skip)))
    pump(worker, lambda: "r1" not in worker.jobs and worker.in_flight == 0)
    assert not messages(worker, protocol.MediaFailed)
    return messages(worker, protocol.MediaProbed)[0].plans


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "whole"])
def test_patches_land_at_their_rows_and_ready_counts_grow(tmp_path, demo_model, clips, streaming):
    worker = make_worker(tmp_path, demo_model, streaming)
    try:
        pages = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(0))[:30].tolist()
        plans = run_request(worker, clips, pages=pages)
        expected = reference_patches(worker, clips)
        rows = [p.grid_thw[0] * p.grid_thw[1] * p.grid_thw[2] for p in plans]
        assert [e.shape[0] for e in expected] == rows and sum(rows) <= len(pages) * PAGE_SIZE
        written = stream_rows(worker, pages)
        offset = 0
        for want, n in zip(expected, rows):
            assert torch.equal(written[offset:offset + n], want)
            offset += n
        assert torch.all(written[offset:] == SENTINEL)  # nothing past the stream's end
        ready = messages(worker, protocol.MediaReady)
        assert {m.media_index for m in ready} == {0, 1, 2}
        for index, plan in enumerate(plans):
            counts = [m.num_rows for m in ready if m.media_index == index]
            assert counts[-1] is None and None not in counts[:-1]  # exactly one final message, the last
            partial = counts[:-1]
            slice_rows = plan.grid_thw[1] * plan.grid_thw[2]
            assert partial == sorted(set(partial)) and all(0 < n < rows[index] and n % slice_rows == 0
                                                           for n in partial)
            if not streaming or plan.kind == "image":
                assert partial == []
            starts = {m.decode_start for m in ready if m.media_index == index}  # one decode start per media
            assert len(starts) == 1 and 0 < starts.pop() <= time.time()
        if streaming:  # the long video (4 slices over 8 slow GOP segments) is announced before it is whole
            assert len([m for m in ready if m.media_index == 0]) >= 2
    finally:
        worker.close()


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "whole"])
def test_skipped_media_are_cancelled_and_never_written(tmp_path, demo_model, clips, streaming):
    worker = make_worker(tmp_path, demo_model, streaming, delay_s=0.2)
    try:
        pages = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(1))[:30].tolist()
        plans = run_request(worker, clips, pages=pages, skip=[0], write_after_first_part=False)
        expected = reference_patches(worker, clips)
        rows = [p.grid_thw[0] * p.grid_thw[1] * p.grid_thw[2] for p in plans]
        written = stream_rows(worker, pages)
        # media 1 and 2 follow one another from row 0, as if media 0 were absent
        assert torch.equal(written[:rows[1]], expected[1])
        assert torch.equal(written[rows[1]:rows[1] + rows[2]], expected[2])
        assert torch.all(written[rows[1] + rows[2]:] == SENTINEL)
        others = [p for p in range(NUM_PAGES) if p not in pages]
        assert torch.all(worker.patch_buffer.tensor[others] == SENTINEL)
        assert {m.media_index for m in messages(worker, protocol.MediaReady)} == {1, 2}
        assert not worker.engine._in_flight and not worker.engine._streams  # its decode was stopped, not finished
    finally:
        worker.close()


def test_everything_skipped_ends_the_request_at_once(tmp_path, demo_model, clips):
    worker = make_worker(tmp_path, demo_model, True, delay_s=0.2)
    try:
        started = time.perf_counter()
        run_request(worker, clips[:1], pages=[0], skip=[0], write_after_first_part=False)
        assert time.perf_counter() - started < 0.7  # its 8 GOP segments at 0.2 s on 2 slots take >= 0.8 s
        assert messages(worker, protocol.MediaReady) == []
        assert torch.all(worker.patch_buffer.tensor == SENTINEL)
    finally:
        worker.close()


def test_a_video_is_probed_once_per_media_key(tmp_path, demo_model, clips, monkeypatch):
    import flashcodec.decode.engine as engine_module

    probed = []
    real = engine_module.probe
    monkeypatch.setattr(engine_module, "probe", lambda src: probed.append(src.name) or real(src))
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

    from unifiedserve.runtime.vision_worker import ProbeCache

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


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "whole"])
def test_rows_have_landed_before_core_hears_of_them(tmp_path, demo_model, clips, streaming):
    """Core reads the pool from another process with nothing ordering its CUDA stream after this one's:
    every MediaReady follows a barrier, and no write comes between that barrier and the message."""
    worker = make_worker(tmp_path, demo_model, streaming)
    events = []
    write, send = worker.patch_buffer.write, worker.send
    worker.patch_buffer.write = lambda src, index: (events.append("write"), write(src, index))
    worker._published = lambda: events.append("barrier")
    worker.send = lambda peer, message: (events.append(type(message).__name__), send(peer, message))
    try:
        run_request(worker, clips, pages=list(range(30)))
        ready = [i for i, e in enumerate(events) if e == "MediaReady"]
        assert len(ready) >= 3  # one per media at least
        for i in ready:
            last = [e for e in events[:i] if e in ("write", "barrier")][-1]
            assert last == "barrier", events[:i + 1]
    finally:
        worker.close()


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


def video_bytes(worker, rid):
    plan = next(m for m in messages(worker, protocol.MediaProbed) if m.request_id == rid).plans[0]
    t, h, w = plan.grid_thw
    return t * h * w * worker.patch_buffer.dim * worker.patch_buffer.dtype.itemsize


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "whole"])
def test_videos_waiting_for_admission_decode_within_the_ahead_bound(tmp_path, demo_model, clips, streaming):
    """With a bound below one video, one waiting request's video decodes at a time (alone past the bound);
    an admitted request's video starts at once and is not counted; admission gives the bytes back and the
    next one starts."""
    worker = make_worker(tmp_path, demo_model, streaming, delay_s=0.03)
    worker.ahead_limit = 1  # bytes: less than any video
    a, b = clips[0], clips[2]
    try:
        for n, (rid, media) in enumerate((("r1", a), ("r2", a), ("r3", b))):  # probed in this order
            worker.handle(protocol.ProbeMedia(rid, [media]))
            pump(worker, lambda: len(messages(worker, protocol.MediaProbed)) == n + 1)
        size = {rid: video_bytes(worker, rid) for rid in ("r1", "r2", "r3")}
        assert [(j.request_id, i) for j, i, _, _ in worker.waiting] == [("r2", 0), ("r3", 0)]
        assert worker.held_bytes == size["r1"]  # decoding or decoded, held until written
        pump(worker, lambda: worker.in_flight == 0)  # r1 decoded; nobody took its patches yet
        assert worker.held_bytes == size["r1"] and len(worker.waiting) == 2
        worker.handle(protocol.WritePatches("r3", list(range(32, 48)), []))  # admitted: starts past the bound,
        assert [j.request_id for j, *_ in worker.waiting] == ["r2"]       # and its pages, not vision, hold it
        assert worker.held_bytes == size["r1"]
        worker.handle(protocol.WritePatches("r1", list(range(0, 16)), []))  # admitted: r2 may start now
        assert not worker.waiting and worker.held_bytes == size["r2"]
        pump(worker, lambda: "r1" not in worker.jobs)
        worker.handle(protocol.WritePatches("r2", list(range(16, 32)), []))
        pump(worker, lambda: not worker.jobs and worker.in_flight == 0)
        assert worker.held_bytes == 0 and not worker.waiting
        assert not messages(worker, protocol.MediaFailed)
        want_a, want_b = reference_patches(worker, [a, b])
        rows = worker.patch_buffer.tensor.view(-1, worker.patch_buffer.dim)
        assert torch.equal(rows[16 * PAGE_SIZE:16 * PAGE_SIZE + want_a.shape[0]], want_a)  # r2, decoded late
        assert torch.equal(rows[32 * PAGE_SIZE:32 * PAGE_SIZE + want_b.shape[0]], want_b)
        done = {m.request_id for m in messages(worker, protocol.MediaReady) if m.num_rows is None}
        assert done == {"r1", "r2", "r3"}
    finally:
        worker.close()


def test_a_cancelled_request_gives_its_share_back_and_leaves_the_queue(tmp_path, demo_model, clips):
    worker = make_worker(tmp_path, demo_model, streaming=True, delay_s=0.05)
    worker.ahead_limit = 1
    try:
        for n, rid in enumerate(("r1", "r2", "r3")):  # probed in this order
            worker.handle(protocol.ProbeMedia(rid, [clips[0]]))
            pump(worker, lambda: len(messages(worker, protocol.MediaProbed)) == n + 1)
        key3 = worker.jobs["r3"].key_ids[0]
        worker.handle(protocol.CancelMedia("r3"))  # waiting: dropped, its analysis forgotten
        worker.handle(protocol.CancelMedia("r1"))  # decoding: its share comes back, r2 starts
        assert not worker.waiting and set(worker.jobs) == {"r2"}
        assert worker.held_bytes == video_bytes(worker, "r2")
        assert key3 not in worker.engine._analyses
        worker.handle(protocol.WritePatches("r2", list(range(16)), []))
        pump(worker, lambda: not worker.jobs and worker.in_flight == 0)
        assert worker.held_bytes == 0
        assert {m.request_id for m in messages(worker, protocol.MediaReady)} == {"r2"}
    finally:
        worker.close()


def test_images_decoded_ahead_of_admission_count_toward_the_bound(tmp_path, demo_model, clips):
    """A request's probe decodes its images, held until admission: they are charged to the decode-ahead bound
    when the probe ends, so a later image probe (and a waiting video) waits until an admission gives the
    bytes back. Two image probes may run at once, a third waits; a video-only probe never waits; a request
    cancelled while its probe waits is never probed."""
    worker = make_worker(tmp_path, demo_model, streaming=False, delay_s=0.01)
    worker.ahead_limit = 1  # bytes: less than any image
    image, video = clips[1], clips[2]
    try:
        for rid, media in (("r1", [image]), ("r2", [image]), ("r3", [video]), ("r4", [image]), ("r5", [image])):
            worker.handle(protocol.ProbeMedia(rid, media))
        assert worker.image_probing == {"r1", "r2"}  # r1 alone, r2 beside it (nothing held yet)
        assert [j.request_id for j in worker.probe_queue] == ["r4", "r5"]
        pump(worker, lambda: len(messages(worker, protocol.MediaProbed)) == 3)
        probed = [m.request_id for m in messages(worker, protocol.MediaProbed)]
        assert sorted(probed) == ["r1", "r2", "r3"]
        rows = {rid: worker.jobs[rid].patches[0].shape[0] for rid in ("r1", "r2")}
        image_bytes = rows["r1"] * worker.patch_buffer.dim * 4  # float32 patches of the CPU path
        assert rows["r1"] == rows["r2"] and worker.held_bytes == 2 * image_bytes
        assert [j.request_id for j, *_ in worker.waiting] == ["r3"]  # its video waits for the bound too
        assert worker.stats()["vision_probes_waiting"] == 2 and worker.in_flight == 0
        worker.handle(protocol.CancelMedia("r5"))  # while its probe waits: it never runs
        worker.handle(protocol.WritePatches("r1", [0, 1], []))
        assert worker.held_bytes == image_bytes and [j.request_id for j in worker.probe_queue] == ["r4"]
        worker.handle(protocol.WritePatches("r2", [2, 3], []))  # nothing held: r3's video starts (probed first)
        video_bytes = worker.jobs["r3"].charged[0]
        assert worker.held_bytes == video_bytes and worker.image_probing == set()
        assert [j.request_id for j in worker.probe_queue] == ["r4"]  # and holds the bound: r4 still waits
        worker.handle(protocol.WritePatches("r3", list(range(4, 20)), []))
        assert worker.held_bytes == 0 and worker.image_probing == {"r4"} and not worker.probe_queue
        pump(worker, lambda: len(messages(worker, protocol.MediaProbed)) == 4)
        assert worker.held_bytes == image_bytes
        worker.handle(protocol.WritePatches("r4", [20, 21], []))
        pump(worker, lambda: not worker.jobs and worker.in_flight == 0)
        assert worker.held_bytes == 0 and not messages(worker, protocol.MediaFailed)
        assert {m.request_id for m in messages(worker, protocol.MediaProbed)} == {"r1", "r2", "r3", "r4"}
        want = reference_patches(worker, [image])[0]
        for first_page in (0, 2, 20):  # each image's rows, from its own pages
            assert torch.equal(stream_rows(worker, [first_page, first_page + 1])[:want.shape[0]], want)
    finally:
        worker.close()


@pytest.mark.cuda
@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "whole"])
def test_on_a_gpu_patches_are_made_and_written_there(tmp_path, demo_model, clips, streaming):
    """A CUDA server's vision process: NVDEC (when it works here) and CPU decoders put frames on the GPU,
    patches are cut there in the pool's bfloat16 and written GPU to GPU; the rows equal the CPU path's
    within a pixel level on average (NVDEC's colour conversion and the GPU resize round differently)."""
    from flashcodec.devices import nvdec_unavailable_reason
    from flashcodec.patches import OPENAI_CLIP_STD
    from unifiedserve.memory.buffers import PagedBuffer
    from unifiedserve.runtime.worker import pool_barrier

    device = torch.device("cuda", 0)
    worker = make_worker(tmp_path, demo_model, streaming)
    worker.engine.close()
    worker.patch_buffer = PagedBuffer(NUM_PAGES, PAGE_SIZE, 1176, dtype=torch.bfloat16, device=device)
    worker.patch_buffer.tensor.fill_(SENTINEL)
    worker.engine = DecodeEngine("pyav", 2, devices="auto", output_device=device, nvdec_sessions=4)
    worker._published = pool_barrier(device)
    try:
        assert worker.engine.layout.gpus == (() if nvdec_unavailable_reason(0) else (0,))
        pages = list(range(30))
        plans = run_request(worker, clips, pages=pages)
        rows = [p.grid_thw[0] * p.grid_thw[1] * p.grid_thw[2] for p in plans]
        written = stream_rows(worker, pages).float().cpu()
        level = 1.0 / 255 / min(OPENAI_CLIP_STD)  # one pixel level in patch units, at its largest
        offset = 0
        for want, n in zip(reference_patches(worker, clips), rows):
            assert (written[offset:offset + n] - want).abs().mean().item() <= level
            offset += n
        assert torch.all(written[offset:] == SENTINEL)
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


def test_a_probe_only_request_is_answered_and_forgotten(tmp_path, demo_model, clips):
    """``/tokenize``'s probe: the same grids as a request's probe, then nothing kept, queued or decoded
    (the videos' analyses are dropped from the decode engine, no bytes are held ahead)."""
    worker = make_worker(tmp_path, demo_model, streaming=True, delay_s=0.05)
    try:
        worker.handle(protocol.ProbeMedia("t1", clips, probe_only=True))
        pump(worker, lambda: messages(worker, protocol.MediaProbed))
        only = messages(worker, protocol.MediaProbed)[0]
        assert only.request_id == "t1" and [p.kind for p in only.plans] == ["video", "image", "video"]
        assert not worker.jobs and not worker.waiting and worker.held_bytes == 0 and worker.in_flight == 0
        assert not worker.engine._analyses, "the videos' analyses are forgotten, never decoded"
        for _ in range(20):  # nothing starts later either
            worker.step()
        assert worker.in_flight == 0 and not messages(worker, protocol.MediaReady)
        worker.handle(protocol.CancelMedia("t1"))  # the api's abort after the answer is harmless
        worker.sent.clear()
        plans = run_request(worker, clips, pages=list(range(NUM_PAGES)))  # a real request: the same grids
        assert plans == only.plans
    finally:
        worker.close()
