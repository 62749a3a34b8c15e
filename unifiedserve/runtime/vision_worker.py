"""The vision process: probes media, decodes them with FlashCodec, writes patches into the shared patch pool.

For a request (``ProbeMedia``) it probes every video (a demux scan) and decodes every image on a
small thread pool, and answers api at once with the patch grids (``MediaProbed``), so the prompt
length is known before a frame is decoded. On a GPU (:mod:`unifiedserve.runtime.vision_devices` says which
decoders) a request's images are decoded as one batch per pixel budget (JPEGs on nvJPEG, the rest on CPU
threads) and cut into patches there; on the CPU the probe thread decodes them one after another. Video decoding starts
right after the probe, on FlashCodec's shared decoder threads, within the decode-ahead bound
(``--vision-ahead-gb``, see :meth:`VisionWorker._start_decodes`); a request with images starts its
probe within the same bound (:meth:`VisionWorker._start_probes`), as its images are held until
admission too. When core has admitted the request
(``WritePatches``, the pages of its patch stream) and a media's patches are ready, this process
copies them into those pages and tells core (``MediaReady``). Writes happen on the loop thread, in the order of core's
messages, so a ``CancelMedia`` from core is always seen before its pages are handed to anyone else.

Streaming ingest (``RuntimeConfig.streaming_ingest``, ``--ingest streaming``): a video is decoded
as a FlashCodec stream, and each new prefix of whole temporal slices is written into the pages as
soon as it is decoded (or when the pages arrive, for slices decoded before) and announced with a
``MediaReady`` carrying the rows written so far; no copy of the whole video's patches is ever held.
With whole-video hand-off a video's patches are written, and announced, once it is all decoded.
Media core already holds (``WritePatches.skip_media``) are cancelled and never written; the
other media's patches follow one another in the pages as if those were absent.

A video's probe is kept by its media key (:class:`ProbeCache`), so a later question about the same
file (same size, modification time and inode: ``server/media_key.py``) skips the demux scan.

This module is the loop thread: messages, events, the decode-ahead bound and the patch writes. The work on
other threads (probes, decodes), the request's state and the probe cache are in
:mod:`unifiedserve.runtime.vision_decoding`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from flashcodec import DecodeEngine
from flashcodec.image_batch import ImageBatchDecoder
from unifiedserve import ops
from unifiedserve.memory.buffers import PagedBuffer
from unifiedserve.memory.pages import RaggedIndex
from unifiedserve.model.processor import load_processor
from unifiedserve.runtime import protocol
from unifiedserve.runtime.shm import open_pool
from unifiedserve.runtime.vision_decoding import MediaDecoding, ProbeCache, _Job
from unifiedserve.runtime.vision_devices import (decode_devices, describe_decoders, image_decode_gpu,
                                                 warm_gpu_kernels, write_op)
from unifiedserve.runtime.worker import Worker, device_memory_gauges, pool_barrier

BUSY_POLL_MS = 5  # inbox poll while probes or decodes are in flight (their results arrive on a queue)
PROBE_THREADS = 2  # probes at a time of requests with images (decoded there), and as many of the rest (demux scans)


class VisionWorker(MediaDecoding, Worker):
    name = "vision"
    inbox_type = protocol.ToVision

    def setup(self) -> dict[str, str]:
        cfg = self.config
        processor = load_processor(cfg.model)
        self.spec = processor.patch_spec
        self.image_pixels = (processor.image_min_pixels, processor.image_max_pixels)
        storage = open_pool(cfg.pools["patch"])
        self.patch_buffer = PagedBuffer(*storage.shape, dtype=storage.dtype, storage=storage)
        device = self.patch_buffer.device  # cuda:0 on a CUDA server (its GPU is the only one this process sees)
        # decoded frames live where the patch buffer does, and are cut into patches of its dtype there
        self.engine = DecodeEngine("auto", cfg.vision_threads or None,
                                   devices=decode_devices(cfg.vision_device, device), output_device=device)
        self._published = pool_barrier(device)
        # the paged write's native op (csrc/), built or loaded now rather than inside the first request's first
        # patch write: loading the built extension took 0.10-0.13 s on the 2-core CPU machine, on that request's
        # way to its first encode step (the milestones first_part_decoded -> first_part_written)
        ops.native_available()
        if device.type == "cuda":
            warm_gpu_kernels(self.spec, device, self.patch_buffer.dtype)
        image_gpu = image_decode_gpu(cfg.vision_device, device)
        #: a request's images in batches (nvJPEG, CPU threads for the rest), results on the buffer's GPU;
        #: None: each image is decoded on the CPU by the probe thread
        self.image_decoder = None if image_gpu is None else \
            ImageBatchDecoder(str(image_gpu), cpu_threads=cfg.vision_threads or None, output_device=device)
        # probes of requests with images (their images are decoded there) and of the rest (a demux scan per video)
        # on pools of their own: image-heavy requests never queue a video's probe behind their decodes
        self.probe_pool = ThreadPoolExecutor(PROBE_THREADS, thread_name_prefix="probe")
        self.scan_pool = ThreadPoolExecutor(PROBE_THREADS, thread_name_prefix="scan")
        self.probes = ProbeCache()
        self.events: queue.Queue = queue.Queue()
        self.jobs: dict[str, _Job] = {}
        self.in_flight = 0  # probes and decodes running on other threads
        self._lock = threading.Lock()
        #: videos probed and not yet decoding, in arrival order: (job, media index, analysis, patch bytes)
        self.waiting: deque[tuple[_Job, int, object, int]] = deque()
        self.probe_queue: deque[_Job] = deque()  # requests with images whose probe waits (_start_probes)
        self.image_probing: set[str] = set()  # requests with images whose probe runs
        self.held_bytes = 0  # ahead of admission: videos' planned patches (decoding or decoded), images' decoded ones
        self.ahead_limit = int(cfg.vision_ahead_gb * 2**30)
        images = "cpu" if self.image_decoder is None else f"nvjpeg {image_gpu} + cpu threads"
        return {"decoder": describe_decoders(self.engine), "image_decoder": images, "patch_write": write_op(device),
                "patch_buffer": f"{storage.shape[0]} pages x {storage.shape[1]} rows x {storage.shape[2]} on {device}"}

    def has_work(self) -> bool:
        return not self.events.empty()

    def _drain(self, timeout_ms: int) -> None:
        super()._drain(min(timeout_ms, BUSY_POLL_MS) if self.in_flight else timeout_ms)

    def stats(self) -> dict[str, float]:
        return {"vision_requests": len(self.jobs), "vision_in_flight": self.in_flight,
                "vision_waiting": len(self.waiting), "vision_probes_waiting": len(self.probe_queue),
                "vision_ahead_bytes": self.held_bytes,
                **device_memory_gauges(self.patch_buffer.device)}  # on CUDA: decoded frames and patches in flight

    # -- messages ----------------------------------------------------------------------------------
    def handle(self, message) -> None:
        self._handle(message)
        self._start_ready()

    def _start_ready(self) -> None:
        """Start what the decode-ahead bound lets start: waiting videos first (probed earlier), then probes."""
        if self.waiting:
            self._start_decodes()
        if self.probe_queue:
            self._start_probes()

    def _handle(self, message) -> None:
        if isinstance(message, protocol.ProbeMedia):
            job = _Job(message.request_id, message.media, probe_only=message.probe_only)
            self.jobs[job.request_id] = job
            if any(ref.kind == "image" for ref in job.media):
                self.probe_queue.append(job)  # its probe decodes its images: within the bound (_start_probes)
            else:
                self._submit_probe(job)
        elif isinstance(message, protocol.WritePatches):
            job = self.jobs.get(message.request_id)
            if job is not None:
                self._admitted(job, message)
                self._write_ready(job)
        elif isinstance(message, protocol.CancelMedia):
            job = self.jobs.pop(message.request_id, None)
            if job is not None:
                self._release(job)
                self.probe_queue = deque(j for j in self.probe_queue if j is not job)  # never probed
            for key_id in job.key_ids.values() if job is not None else ():
                self.engine.cancel(key_id)  # its decoder slots go to the next request at once

    def _admitted(self, job: _Job, message: protocol.WritePatches) -> None:
        """Take core's pages; drop the media it already has and lay out the others' rows one after another."""
        skip = frozenset(message.skip_media)
        bad = sorted(i for i in skip if not 0 <= i < len(job.plans))
        assert not bad, f"request {job.request_id}: skip_media {bad} out of range for {len(job.plans)} media"
        job.pages, job.skip = message.pages, skip
        self._release(job)  # its patches go into its pages now: they no longer count as held ahead
        offset = 0
        for index, plan in enumerate(job.plans):
            if index in skip:
                key_id = job.key_ids.get(index)
                if key_id is not None:
                    self.engine.cancel(key_id)
                job.patches.pop(index, None)
                job.parts.pop(index, None)
                continue
            job.offsets[index] = offset
            t, h, w = plan.grid_thw
            offset += t * h * w
        assert offset <= len(job.pages) * self.patch_buffer.page_size, \
            f"request {job.request_id}: {offset} patch rows do not fit {len(job.pages)} pages"

    def step(self) -> None:
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
            self._event(*event)
        self._start_ready()

    def _event(self, kind: str, request_id: str, *payload) -> None:
        if kind != "part" or payload[-1]:  # a probe or decode ended (a stream with its last part)
            self.in_flight -= 1
        if kind in ("probed", "failed"):  # (a decode's failure comes after its probe's end: a no-op then)
            self.image_probing.discard(request_id)
        job = self.jobs.get(request_id)
        if kind == "probed" and (job is None or job.probe_only):
            # cancelled meanwhile, or the grids were all it asked for: its videos were analysed but will never
            # be decoded, so forget them
            for _, analysis in payload[2]:
                self.engine.cancel(analysis.key_id)
            if job is not None:
                self.jobs.pop(request_id)
                self.send("api", protocol.MediaProbed(request_id, *payload[:2]))
            return
        if job is None:  # cancelled meanwhile
            return
        if kind == "failed":
            message, index, *status = payload  # status: 503 where the server, not the media, is short
            if index in job.skip:  # core does not need this media any more
                return
            self.jobs.pop(request_id)
            self._release(job)
            for key_id in job.key_ids.values():  # the request fails: its other videos stop too
                self.engine.cancel(key_id)
            self.send("api", protocol.MediaFailed(request_id, message, *status))
        elif kind == "probed":
            plans, probe_s, analyses = payload
            job.plans = plans
            for index, patches in job.patches.items():  # images, decoded by the probe: held until admission
                job.charged[index] = patches.numel() * patches.element_size()
                self.held_bytes += job.charged[index]
            self.send("api", protocol.MediaProbed(request_id, plans, probe_s))
            job.key_ids = {index: analysis.key_id for index, analysis in analyses}
            row_bytes = self.patch_buffer.dim * self.patch_buffer.dtype.itemsize
            for index, analysis in analyses:
                t, h, w = plans[index].grid_thw
                self.waiting.append((job, index, analysis, t * h * w * row_bytes))
        elif kind == "decoded":
            index, patches, decode_s, decoded_at = payload
            if index not in job.skip:
                job.patches[index] = patches
                job.decode_s[index] = decode_s
                job.decoded_at[index] = decoded_at
                self._write_ready(job)
        elif kind == "part":
            index, start, patches, decode_s, decoded_at, _ = payload
            if index not in job.skip:
                assert start == job.rows_decoded.get(index, 0), f"media {index}: part at row {start} out of order"
                job.parts.setdefault(index, []).append((start, patches))
                job.rows_decoded[index] = start + patches.shape[0]
                job.decode_s[index] = decode_s
                job.decoded_at[index] = decoded_at
                self._write_ready(job)

    def _started(self) -> None:
        self.in_flight += 1

    # -- the decode-ahead bound ------------------------------------------------------------------------
    def _start_decodes(self) -> None:
        """Start the waiting videos that may start now, in arrival order.

        Vision decodes a video as soon as it is probed, before core admits its request, so that it is
        ready when pages free up. Held in this process's memory (on the GPU on a CUDA server, where NVDEC
        outruns prefill), those patches would grow without bound under a queue, so a video of a request
        core has not admitted starts only while the patches held ahead of admission (``held_bytes``: the
        planned patches of such videos, decoding or decoded) stay within ``--vision-ahead-gb`` (or when
        nothing is held: a video larger than the bound still goes, alone). A video of an admitted request
        starts at once and is not counted: its rows go into its pages (the patch buffer bounds them), and
        core waits for them. Admission, a cancel or a failure gives the counted bytes back.
        """
        keep: deque = deque()
        blocked = False  # a request not admitted did not fit: later ones wait behind it, admitted ones go
        while self.waiting:
            job, index, analysis, size = entry = self.waiting.popleft()
            if self.jobs.get(job.request_id) is not job or index in job.skip:
                continue  # cancelled, failed or skipped meanwhile (its analysis is cancelled there)
            admitted = job.pages is not None
            if not admitted and (blocked or (self.held_bytes and self.held_bytes + size > self.ahead_limit)):
                blocked = True
                keep.append(entry)
                continue
            if not admitted:
                job.charged[index] = size
                self.held_bytes += size
            self._started()
            job.decode_start[index] = time.time()
            decode = self._decode_streamed if self.config.streaming_ingest else self._decode
            threading.Thread(target=decode, args=(job, index, analysis), daemon=True,
                             name=f"decode-{job.request_id}").start()
        self.waiting = keep

    def _start_probes(self) -> None:
        """Start the probes of requests with images that may start now, in arrival order.

        A probe decodes its request's images, and they are held (on the GPU on a CUDA server) until core
        admits the request, like videos decoded ahead: they count toward the same bound, charged when the
        probe ends and given back on admission, cancel or failure. Such a probe starts while what is held
        stays under ``--vision-ahead-gb`` and fewer than :data:`PROBE_THREADS` of them run, or alone when
        nothing is held or running: vision then holds at most the bound plus the images of the probes that
        started under it (at most ``--max-media-per-request`` images each). Probes of requests without
        images (a demux scan) start at once.
        """
        while self.probe_queue:  # (a request cancelled while its probe waits has left the queue)
            job = self.probe_queue[0]
            idle = not self.held_bytes and not self.image_probing
            if not idle and (self.held_bytes >= self.ahead_limit or len(self.image_probing) >= PROBE_THREADS):
                return
            self.probe_queue.popleft()
            self.image_probing.add(job.request_id)
            self._submit_probe(job)

    def _submit_probe(self, job: _Job) -> None:
        self._started()
        images = any(ref.kind == "image" for ref in job.media)
        (self.probe_pool if images else self.scan_pool).submit(self._probe, job)

    def _release(self, job: _Job) -> None:
        """``job`` no longer holds anything ahead of admission (admitted, cancelled or failed): its videos'
        planned patches and its images' decoded ones."""
        self.held_bytes -= sum(job.charged.values())
        job.charged.clear()

    # -- writing patches -------------------------------------------------------------------------------
    def _write_ready(self, job: _Job) -> None:
        """Write what is decoded and not yet written, once core has given the pages, and announce it:
        one ``MediaReady`` per media and call, ``num_rows`` = rows written so far, None once whole."""
        if job.pages is None:
            return
        for index, plan in enumerate(job.plans):
            if index in job.skip or index in job.written:
                continue
            t, h, w = plan.grid_thw
            rows = t * h * w
            if index in job.patches:
                patches = job.patches.pop(index)
                if patches.shape[0] != rows:
                    raise AssertionError(f"media {index} decoded {patches.shape[0]} patch rows, planned {rows}")
                self._write_rows(job, job.offsets[index], patches)
                job.rows_written[index] = rows
            elif index in job.parts:
                for start, patches in job.parts.pop(index):
                    assert start == job.rows_written.get(index, 0) and start + patches.shape[0] <= rows, \
                        f"media {index}: part [{start}, {start + patches.shape[0]}) of {rows} rows out of order"
                    self._write_rows(job, job.offsets[index] + start, patches)
                    job.rows_written[index] = start + patches.shape[0]
            else:
                continue
            whole = job.rows_written[index] == rows
            if whole:
                job.written.add(index)
            self._published()  # core reads the rows as soon as it hears of them: they must have landed
            self.send("core", protocol.MediaReady(job.request_id, index, job.decode_s.get(index, 0.0),
                                                  None if whole else job.rows_written[index],
                                                  job.decode_start.get(index, 0.0), job.decoded_at.get(index, 0.0),
                                                  time.time()))
        if job.is_done:
            self.jobs.pop(job.request_id, None)

    def _write_rows(self, job: _Job, offset: int, patches: torch.Tensor) -> None:
        """Copy ``patches`` [rows, patch_dim] into the request's patch stream from its row ``offset``."""
        page_size, rows = self.patch_buffer.page_size, patches.shape[0]
        first, last = offset // page_size, -(-(offset + rows) // page_size)
        index = RaggedIndex.build([(rows, offset, job.pages[first:last])], page_size)
        # videos, and images decoded on the GPU, arrive on the buffer's device in its dtype (no copy here);
        # images decoded on the CPU come as float32 CPU tensors and are copied over here
        self.patch_buffer.write(patches.to(device=self.patch_buffer.device, dtype=self.patch_buffer.dtype), index)

    def close(self) -> None:
        if hasattr(self, "engine"):
            self.engine.close()
            self.probe_pool.shutdown(wait=False, cancel_futures=True)
            self.scan_pool.shutdown(wait=False, cancel_futures=True)
            if getattr(self, "image_decoder", None) is not None:
                self.image_decoder.close()
        super().close()
