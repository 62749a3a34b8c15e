"""The asynchronous decode API (paper §5): :class:`DecodeEngine`.

``analyse_bitstream`` probes and plans (cheap, demux only) and returns a key id;
``add_decoding_request`` queues the key's GOP segments on every rank's decoder slots;
``get_decoding_output`` blocks, without holding the GIL, until a request is done. A request
queued with ``stream=True`` is read with ``stream_decoding_output`` instead: its output arrives in
display order, one contiguous part at a time, as soon as the earliest incomplete part is decoded
(the parts are cut by :mod:`flashcodec.decode.streaming`). The process-wide engines and the one-call
``decode_video`` are in :mod:`flashcodec.decode.shared_engine`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
import threading
import time
from typing import Callable

import torch

from flashcodec._errors import DecodeCancelledError, NoFramesError, OutputTooLargeError
from flashcodec.decode.backends import Backend
from flashcodec.decode.cpu import get_backend
from flashcodec.decode.request import (BitstreamAnalysis, DecodedSlice, DecodedVideo, DecodeRequest,
                                       check_output_memory, wait_until)
from flashcodec.decode.rank_job import RankJob
from flashcodec.decode.scheduler import RankGroup, RankScheduler
from flashcodec.decode.streaming import StreamParts
from flashcodec.devices import (DEFAULT_NVDEC_SESSIONS, make_layout, resolve_output_device, video_nvdec_engines,
                                video_nvdec_reason)
from flashcodec.plan.sampling import MAX_FRAME_PIXELS, SamplingOptions
from flashcodec.plan.video import plan_video
from flashcodec._probe import VideoInfo, check_source_size, probe
from flashcodec.resize import DEFAULT_RESIZE_MODE, check_resize_mode
from flashcodec.source import Source, SourceLike

log = logging.getLogger(__name__)

OUTPUTS = ("rgb", "patches")
ON_CORRUPT = ("error", "repeat")


#: The largest stored picture decoded by default: the most luma samples any H.264 or HEVC level allows
#: (:data:`flashcodec.plan.sampling.MAX_FRAME_PIXELS`, 8192x4352; 8K UHD fits).
MAX_SOURCE_PIXELS = MAX_FRAME_PIXELS


class DecodeEngine:
    """A process-wide pool of decoders (ranks x slots) serving many requests at once.

    Ranks: one per GPU in ``devices`` (``nvdec_sessions`` concurrent NVDEC sessions as threads),
    then the CPU rank (``cpu_threads`` software decoders). A video's GOP segments are split over
    every rank that can decode it in proportion to the ranks' speeds, and a rank that runs dry
    takes work from a slower one (:mod:`flashcodec.decode.scheduler`).

    Args:
        backend: the CPU rank's decoder: ``"auto"``, ``"pyav"`` or ``"torchcodec"``.
        num_threads: the CPU rank's decoder slots (the older name of ``cpu_threads``).
        devices: ``"cpu"`` (default), ``"cuda"`` (every GPU), ``"cuda:N"``, ``"auto"`` (every GPU
            whose NVDEC works, and the CPU) or a list. With GPUs alone the CPU rank decodes only
            videos NVDEC cannot (AV1 on H100, H.264 4:4:4, ...); name ``"cpu"`` too to decode with both.
        cpu_threads: decoder slots of the CPU rank; default one per core, less 3 per GPU rank (the host cores
            that rank's NVDEC threads keep busy, ``devices.NVDEC_HOST_CORES``); 0: no CPU rank.
        nvdec_sessions: NVDEC sessions per GPU (default 14: two per engine of an H100).
        output_device: where outputs live; default the first GPU of ``devices``, else the CPU. GPU outputs
            are written on that device's default stream (every decoder thread's current stream) and handed
            out as soon as the writes are queued: read them on that stream, or make your stream wait for it.
        rank_speeds: frames/s per rank name (``"cpu"``, ``"cuda:0"``), replacing the cost model's
            defaults (:mod:`flashcodec.devices`).
        max_source_pixels: the largest stored picture (width x height) a video may have, checked when it
            is analysed, before any frame is decoded (a decoded frame and its conversions cost memory in
            proportion; the caller's ``max_pixels`` bounds only the output). None (default):
            :data:`MAX_SOURCE_PIXELS`.
        request_order: how requests in flight share the decoder slots: ``"fair"`` (default; each slot's next segment
            goes to the request the fewest slots decode, so a short video asked while a long one decodes is not held
            until the long one is done) or ``"fifo"`` (the oldest request's segments first: it finishes soonest).

    Raises:
        ValueError: bad counts, a bad output device, or a device this machine lacks
            (:class:`~flashcodec.devices.DeviceError`, which says why).
    """

    def __init__(self, backend: str | Backend = "auto", num_threads: int | None = None, *,
                 devices: str | list[str] = "cpu", cpu_threads: int | None = None,
                 nvdec_sessions: int = DEFAULT_NVDEC_SESSIONS,
                 output_device: str | torch.device | None = None, rank_speeds: dict[str, float] | None = None,
                 max_source_pixels: int | None = None, request_order: str = "fair"):
        if max_source_pixels is not None and max_source_pixels < 1:
            raise ValueError(f"max_source_pixels must be at least 1, got {max_source_pixels}")
        self.max_source_pixels = MAX_SOURCE_PIXELS if max_source_pixels is None else max_source_pixels
        if num_threads is not None and cpu_threads is not None:
            raise ValueError("give cpu_threads or num_threads (its older name), not both")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {num_threads}")
        self.layout = make_layout(devices, num_threads if cpu_threads is None else cpu_threads, nvdec_sessions,
                                  rank_speeds)
        self.output_device = resolve_output_device(output_device, self.layout.output_gpu)
        self.backend = backend if isinstance(backend, Backend) else get_backend(backend, self.max_source_pixels)
        self.num_threads = self.layout.cpu_threads
        group = RankGroup(request_order)
        try:
            if self.layout.gpus:
                from flashcodec.decode.nvdec import NvdecBackend

                for gpu, speed in zip(self.layout.gpus, self.layout.speeds):
                    RankScheduler(NvdecBackend(gpu, nvdec_sessions), nvdec_sessions, f"cuda:{gpu}", speed=speed,
                                  group=group)
            if self.layout.cpu_threads:
                RankScheduler(self.backend, self.num_threads, name=self.backend.device, speed=self.layout.speeds[-1],
                              group=group)
        except BaseException:
            group.shutdown()  # no slot thread outlives a failed constructor
            raise
        self._group = group
        self._ranks = group.ranks  # GPU ranks first, then the CPU rank
        self._keys = itertools.count(1)
        self._lock = threading.Lock()
        self._analyses: dict[int, BitstreamAnalysis] = {}
        self._done = threading.Condition()
        self._finished: dict[int, DecodeRequest] = {}
        self._in_flight: set[int] = set()
        self._cancelled: set[int] = set()  # cancelled keys whose get_decoding_output has not raised yet
        self._streams: dict[int, DecodeRequest] = {}  # queued with stream=True, until their reader ends

    @property
    def num_ranks(self) -> int:
        return len(self._ranks)

    def analyse_bitstream(self, source: SourceLike, options: SamplingOptions | None = None, *,
                          frame_indices: list[int] | None = None, info: VideoInfo | None = None,
                          **sampling) -> BitstreamAnalysis:
        """Probe and plan a video. ``sampling`` takes :class:`SamplingOptions` fields (fps, ...).

        ``info``: this source's probe from an earlier call (``BitstreamAnalysis.info``), for a caller that
        knows the source has not changed (e.g. by its size and modification time): the demux scan, about
        10 ms a minute of video, is skipped.
        """
        if options is None:
            options = SamplingOptions(**sampling)
        elif sampling:
            raise TypeError("give either options or sampling keywords, not both")
        started = time.perf_counter()
        src = Source.of(source)
        if info is None:
            info = probe(src, self.max_source_pixels)  # checks the size from the header
        else:  # a probe of the caller's, perhaps under another engine's cap
            check_source_size(src.name, info.width, info.height, self.max_source_pixels)
        speeds, allowed, reason = self.layout.shares(lambda gpu: video_nvdec_reason(info, gpu))
        if reason is not None:
            log.warning("flashcodec: %s decodes on the CPU rank: %s", src.name, reason)
        slot_speeds = self.layout.slot_speeds(speeds, lambda gpu: video_nvdec_engines(info, gpu))
        for rank in sorted(allowed):  # what the ranks' decoders derive from the probe, built once before they open
            self._ranks[rank].backend.prepare(info)
        try:
            plan = plan_video(info, options, num_ranks=self.num_ranks,
                              decoders_per_rank=[r.num_slots for r in self._ranks], frame_indices=frame_indices,
                              rank_speeds=speeds, slot_speeds=slot_speeds)
        except NoFramesError as e:  # the planner knows the probe, not the file: name it, as every other error does
            raise NoFramesError(f"{src.name}: {e}") from None
        analysis = BitstreamAnalysis(next(self._keys), info, plan, time.perf_counter() - started, src,
                                     allowed if len(allowed) < self.num_ranks else None)
        with self._lock:
            self._analyses[analysis.key_id] = analysis
        return analysis

    def add_decoding_request(self, key_id: int, *, output: str = "rgb", on_corrupt: str = "error",
                             patch_spec=None, progress: Callable[[int, int], None] | None = None,
                             resize: str = DEFAULT_RESIZE_MODE, stream: bool = False,
                             patch_dtype: torch.dtype = torch.float32, trace: bool = False) -> None:
        """Queue the decode of an analysed video. Returns at once.

        Args:
            output: ``"rgb"`` (uint8 frames) or ``"patches"`` (normalised Qwen2.5-VL patches).
            on_corrupt: ``"error"`` fails the request if any sampled frame cannot be decoded;
                ``"repeat"`` fills such frames with the nearest decoded one and lists them in
                ``failed_frame_indices``.
            progress: called as ``progress(frames_decoded, frames_to_decode)`` from decoder threads.
            resize: ``"exact"`` (default) converts each sampled frame at full resolution and
                resizes it as Qwen2.5-VL's reference pipeline does (antialiased bicubic);
                ``"fast"`` converts and resizes in one swscale call (cheaper, larger error; see
                docs/flashcodec.md). Other values raise ``ValueError``.
            stream: deliver the output in parts through :meth:`stream_decoding_output` (no whole
                output is assembled; :meth:`get_decoding_output` refuses the key).
            patch_dtype: the patches' dtype (``output="patches"``): a floating type. The values are
                computed in float32 and rounded once to it, as a model casting float32 patches to its
                own dtype would (a bfloat16 server asks for bfloat16 and holds half the memory).
            trace: record when each decoder slot opened its decoder and decoded each segment
                (``DecodedVideo.trace``; a benchmark's view of where a request's time went). A stream's
                trace comes with its last part (``DecodedSlice.trace``), which then waits for every slot
                to end its work on the request (a backup run stops at its next packet).

        Raises:
            KeyError: ``key_id`` is not an analysed request (unknown, cancelled, or queued already).
            OutputTooLargeError: a whole output on the CPU (``stream=False``) larger than the memory this process
                can still take (:func:`~flashcodec.decode.request.check_output_memory`); the analysis is forgotten.
            ValueError: a bad ``output``, ``on_corrupt``, ``resize`` or ``patch_dtype``.
        """
        check_resize_mode(resize)
        if not isinstance(patch_dtype, torch.dtype) or not patch_dtype.is_floating_point:
            raise ValueError(f"patch_dtype must be a floating torch dtype, got {patch_dtype!r}")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if on_corrupt not in ON_CORRUPT:
            raise ValueError(f"on_corrupt must be one of {ON_CORRUPT}, got {on_corrupt!r}")
        with self._lock:
            analysis = self._analyses.get(key_id)
        if analysis is None:
            raise KeyError(f"unknown or already queued key id {key_id}")
        if not stream and self.output_device.type == "cpu":  # a stream's parts are freed as they are read
            try:  # while the analysis is still registered: a cancel meanwhile finds it and forgets it
                check_output_memory(analysis.plan, output, patch_dtype)
            except OutputTooLargeError:
                self.cancel(key_id)  # refused: nothing of the request is kept
                raise
        with self._lock:
            if self._analyses.pop(key_id, None) is None:  # cancelled (or queued by another thread) meanwhile
                raise KeyError(f"unknown or already queued key id {key_id}")
            self._in_flight.add(key_id)
        request = DecodeRequest(analysis, output, on_corrupt, patch_spec, progress, self._request_done,
                                self.output_device, stream=stream, patch_dtype=patch_dtype, trace=trace)
        if stream:
            with self._done:
                self._streams[key_id] = request
        plan = analysis.plan
        allowed = analysis.allowed_ranks
        fallback = self.layout.fallback_ranks(allowed)  # the CPU rank, should every GPU that takes the video fail it
        for rank_plan, scheduler in zip(plan.ranks, self._ranks):
            scheduler.submit(RankJob(  # a rank that steals a segment opens the video on its own backend
                key_id, rank_plan,
                open_decoder=lambda b: b.open(analysis.source, analysis.info, plan.height, plan.width, resize=resize),
                emit=request.emit, on_segment_done=request.segment_done, on_finished=request.rank_finished,
                allowed_ranks=allowed, trace=request.trace, emit_many=request.emit_many, fallback_ranks=fallback,
                in_order=stream,  # a stream hands out its prefix: every slot takes the earliest segment left
            ))

    def cancel(self, key_id: int) -> bool:
        """Stop a request: an analysed one is forgotten, a queued one's segments are dropped, running
        segments stop at their next packet, and its frame buffers are freed. Returns at once.

        A later (or waiting) :meth:`get_decoding_output` of ``key_id`` raises
        :class:`~flashcodec.DecodeCancelledError`. Returns False for a key that is unknown or finished.
        """
        with self._lock:
            if self._analyses.pop(key_id, None) is not None:
                return True
        with self._done:
            if key_id not in self._in_flight:
                return False
            self._cancelled.add(key_id)
            request = self._streams.get(key_id)
        if request is not None:  # its reader stops handing out parts at once
            with request.changed:
                request.cancelled = True
                request.changed.notify_all()
        self._group.cancel(key_id, DecodeCancelledError(f"decoding request {key_id} was cancelled"))
        return True

    def _request_done(self, request: DecodeRequest) -> None:
        key_id = request.analysis.key_id
        with self._done:
            self._in_flight.discard(key_id)
            if key_id not in self._cancelled:  # a cancelled request's frames are dropped here
                if not request.stream:  # a streamed one's reader holds it
                    self._finished[key_id] = request
            elif request.stream and request.abandoned:  # no reader will ever raise for it
                self._cancelled.discard(key_id)
                self._streams.pop(key_id, None)
            self._done.notify_all()

    def get_decoding_output(self, key_id: int | None = None, timeout: float | None = None) -> DecodedVideo:
        """Wait for a request (``key_id``) or for any finished one, and return it.

        The wait releases the GIL. Raises the request's error (e.g. :class:`CorruptVideoError`),
        ``KeyError`` for an unknown key, or ``TimeoutError``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done:
            if key_id in self._streams:
                raise ValueError(f"key id {key_id} was queued with stream=True: read it with stream_decoding_output")
            while True:
                if key_id is not None and key_id in self._cancelled and key_id not in self._in_flight:
                    self._cancelled.discard(key_id)
                    raise DecodeCancelledError(f"decoding request {key_id} was cancelled")
                if key_id is None and self._finished:
                    key = next(iter(self._finished))
                elif key_id is not None and key_id in self._finished:
                    key = key_id
                else:
                    if key_id is not None and key_id not in self._in_flight:
                        raise KeyError(f"key id {key_id} was never queued (call add_decoding_request first)")
                    if key_id is None and not self._in_flight - self._streams.keys():
                        raise KeyError("no decoding request is in flight")
                    wait_until(self._done, deadline, timeout)
                    continue
                request = self._finished.pop(key)
                break
        if request.error is not None:
            raise request.error
        return request.result

    def stream_decoding_output(self, key_id: int, timeout: float | None = None) -> Iterator[DecodedSlice]:
        """Yield a streamed request's output (``add_decoding_request(..., stream=True)``) as it completes.

        Parts come in display order, each starting where the previous one stopped, as soon as the
        prefix of final rows grows (ranks and decoder slots finish out of order; the prefix grows when
        its earliest incomplete frame is done): every new frame for ``output="rgb"``, every new whole
        temporal patch for ``output="patches"``. Patches are made from each part's frames alone, and
        a rank's frame buffer is freed once all its frames are handed out, so no copy of the whole
        output exists. Waits release the GIL. Closing the iterator before its end cancels the request.

        Raises:
            KeyError: ``key_id`` was not queued with ``stream=True`` (or was read already).
            DecodeCancelledError: the request was cancelled (:meth:`cancel`), possibly after some parts.
            TimeoutError: the whole stream took longer than ``timeout`` seconds.
            The request's error (e.g. :class:`CorruptVideoError`) once the parts before it are out.
        """
        with self._done:
            request = self._streams.get(key_id)
            if request is None and key_id in self._cancelled and key_id not in self._in_flight:
                self._cancelled.discard(key_id)
                raise DecodeCancelledError(f"decoding request {key_id} was cancelled")
        if request is None:
            raise KeyError(f"key id {key_id} was not queued with stream=True, or its stream was read already")
        return self._stream(request, timeout)

    def _stream(self, request: DecodeRequest, timeout: float | None) -> Iterator[DecodedSlice]:
        key_id = request.analysis.key_id
        parts = StreamParts(request)
        deadline = None if timeout is None else time.monotonic() + timeout
        ended = False
        try:
            yield from parts.read(deadline, timeout)
            with self._done:  # finished, or about to be when cancelled: wait for its end to be recorded
                while key_id in self._in_flight:
                    wait_until(self._done, deadline, timeout)
                ended = True
                self._streams.pop(key_id, None)
                if key_id in self._cancelled:
                    self._cancelled.discard(key_id)
                    raise DecodeCancelledError(f"decoding request {key_id} was cancelled")
            if request.error is not None:
                raise request.error
        finally:
            request.rank_outputs.clear()
            if not ended:  # the reader went away (or timed out): stop the work nobody will read
                request.abandoned = True
                if not self.cancel(key_id):
                    with self._done:
                        self._streams.pop(key_id, None)
                        self._cancelled.discard(key_id)

    def decode_video(self, source: SourceLike, *, output: str = "rgb", on_corrupt: str = "error",
                     frame_indices: list[int] | None = None, patch_spec=None,
                     progress: Callable[[int, int], None] | None = None, resize: str = DEFAULT_RESIZE_MODE,
                     **sampling) -> DecodedVideo:
        """Probe, plan and decode in one call. See :class:`SamplingOptions` for ``sampling`` and
        :meth:`add_decoding_request` for the other options."""
        check_resize_mode(resize)  # before probing: a bad option fails fast
        analysis = self.analyse_bitstream(source, frame_indices=frame_indices, **sampling)
        try:
            self.add_decoding_request(analysis.key_id, output=output, on_corrupt=on_corrupt,
                                      patch_spec=patch_spec, progress=progress, resize=resize)
        except BaseException:
            self.cancel(analysis.key_id)  # a refused request's analysis is not kept
            raise
        return self.get_decoding_output(analysis.key_id)

    def close(self) -> None:
        for scheduler in self._ranks:
            scheduler.shutdown()

    def __enter__(self) -> "DecodeEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
