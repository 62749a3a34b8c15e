"""The vision process in-process: patches land at their rows of the request's pages, streamed slice by
slice or whole, and media core already has (``skip_media``) are neither decoded to the end nor written."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from flashcodec import DecodeEngine
from unifiedserve.runtime import protocol
from vision_helpers import NUM_PAGES, PAGE_SIZE, SENTINEL, make_worker, messages, pump, reference_patches, \
    run_request, stream_rows


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


@pytest.mark.parametrize("failure", ["too long", "a later media unreadable"])
def test_a_request_whose_probe_fails_leaves_no_analysis_behind(tmp_path, demo_model, clips, failure):
    """The videos a failed probe analysed before it failed (the one over --max-video-seconds too) are forgotten by
    the decode engine: each held its source (an inline video's bytes, whole), and nothing else would free it. Any
    client could grow the vision process without bound (15 too-long 20-MB inline videos: +250 MB)."""
    worker = make_worker(tmp_path, demo_model, streaming=True, delay_s=0.05)
    try:
        if failure == "too long":
            worker.config = dataclasses.replace(worker.config, max_video_seconds=3.0)  # the first clip is 4 s
            media = clips
        else:
            bad = tmp_path / "bad.mp4"
            bad.write_bytes(b"not a video at all" * 100)
            media = [clips[0], clips[2], protocol.MediaRef("video", path=str(bad))]
        for i in range(3):
            worker.handle(protocol.ProbeMedia(f"r{i}", media))
            pump(worker, lambda: len(messages(worker, protocol.MediaFailed)) > i)
        assert len(messages(worker, protocol.MediaFailed)) == 3 and not messages(worker, protocol.MediaProbed)
        assert not worker.engine._analyses and not worker.jobs and worker.in_flight == 0
    finally:
        worker.close()


def test_a_videos_probe_never_queues_behind_image_decodes(tmp_path, demo_model, clips, monkeypatch):
    """Requests with images decode them in their probes; those run on a pool of their own, so two image-heavy
    requests (here 1 s an image) do not hold a video-only request's demux scan (4.85 s behind two requests of
    three 24-MP PNGs before)."""
    from unifiedserve.runtime import vision_decoding

    real = vision_decoding.decode_image

    def slow(*args, **kwargs):
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(vision_decoding, "decode_image", slow)
    worker = make_worker(tmp_path, demo_model, streaming=True, delay_s=0.05)
    try:
        worker.handle(protocol.ProbeMedia("images-a", [clips[1]] * 3))
        worker.handle(protocol.ProbeMedia("images-b", [clips[1]] * 3))
        started = time.perf_counter()
        worker.handle(protocol.ProbeMedia("video", [clips[0]]))
        pump(worker, lambda: any(m.request_id == "video" for m in messages(worker, protocol.MediaProbed)))
        assert time.perf_counter() - started < 1.0
        assert {m.request_id for m in messages(worker, protocol.MediaProbed)} == {"video"}  # images still decoding
    finally:
        worker.close()
