"""The vision process's work off its loop thread: a request's probe (each video's demux scan; its images
decoded there too, one by one on the CPU or in batches per pixel budget on a GPU) on the probe pool, and each
video's decode (whole, or streamed slice by slice) on a thread of its own. Each ends by putting what came of
it on the worker's event queue, which :class:`~unifiedserve.runtime.vision_worker.VisionWorker` handles on
its loop thread. Also the per-request state (:class:`_Job`) and the probe cache by media key
(:class:`ProbeCache`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from flashcodec import DecodeCancelledError, FlashCodecError, OutputTooLargeError, SamplingOptions
from flashcodec._errors import first_line
from flashcodec.decode.trace import describe_trace, rank_slots, trace_summary
from flashcodec.image import decode_image
from flashcodec.source import Source
from unifiedserve.runtime import protocol

log = logging.getLogger("unifiedserve")


def decode_trace_enabled() -> bool:
    """``UNIFIEDSERVE_DECODE_TRACE=1``: each video's decode is traced and logged in one line (which rank and slot
    decoded its first segment and when, each rank's opens, segments and end). A diagnosis switch: a traced stream's
    last part waits for every slot to end its work, backups included."""
    return os.environ.get("UNIFIEDSERVE_DECODE_TRACE", "") in ("1", "on", "true")


#: what the probes kept may hold: an hour of 30-fps video's probe is about 1.7 MB (two int64 per frame)
PROBE_CACHE_BYTES = 64 << 20


class ProbeCache:
    """Video probes (``VideoInfo``) by media key, least recently used out past ``max_bytes``; thread-safe
    (probes run on a thread pool). A key names the file's identity and the request's options, so a file
    changed on disk has another key and is probed again; media without a key are never kept."""

    def __init__(self, max_bytes: int = PROBE_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple] = OrderedDict()  # key -> (info, bytes)
        self._lock = threading.Lock()

    @staticmethod
    def size(info) -> int:
        return 256 + sum(a.nbytes for a in (info.frame_pts, info.decode_positions, info.keyframe_positions))

    def get(self, key: str):
        with self._lock:
            entry = self._entries.get(key) if key else None
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: str, info) -> None:
        size = self.size(info)
        if not key or size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self.bytes += size - (old[1] if old else 0)
            self._entries[key] = (info, size)
            while self.bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class _Job:
    request_id: str
    media: list[protocol.MediaRef]
    plans: list[protocol.MediaPlan] = field(default_factory=list)
    patches: dict[int, torch.Tensor] = field(default_factory=dict)  # whole media decoded, not yet written
    #: streamed videos: decoded parts not yet written, as (first patch row of the media, patches [rows, dim])
    parts: dict[int, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    decode_s: dict[int, float] = field(default_factory=dict)  # so far, for a video still streaming
    decode_start: dict[int, float] = field(default_factory=dict)  # time.time() its decode began, per media
    decoded_at: dict[int, float] = field(default_factory=dict)  # time.time() FlashCodec handed over its newest rows
    rows_decoded: dict[int, int] = field(default_factory=dict)  # streamed videos: rows decoded so far
    rows_written: dict[int, int] = field(default_factory=dict)  # rows in the pages, per media
    written: set[int] = field(default_factory=set)  # media whose every row is written and announced
    pages: list[int] | None = None  # from core's WritePatches
    skip: frozenset[int] = frozenset()  # media core already has (WritePatches.skip_media)
    offsets: dict[int, int] = field(default_factory=dict)  # first row of each written media in the pages
    key_ids: dict[int, int] = field(default_factory=dict)  # media index -> FlashCodec request decoding it
    #: bytes charged to the decode-ahead bound per video started before admission (see _start_decodes)
    charged: dict[int, int] = field(default_factory=dict)
    probe_only: bool = False  # ProbeMedia.probe_only: answered, then forgotten

    @property
    def is_done(self) -> bool:
        return len(self.written) + len(self.skip) == len(self.plans)



class MediaDecoding:
    """:class:`~unifiedserve.runtime.vision_worker.VisionWorker`'s methods that run on other threads (the
    probe pool, a decode thread per video). Mixed into it: they use what its ``setup`` made (``config``,
    ``spec``, ``image_pixels``, ``patch_buffer``, ``engine``, ``image_decoder``, ``probes``, ``events``)."""

    # -- work on other threads -----------------------------------------------------------------------
    def _probe(self, job: _Job) -> None:
        start = time.perf_counter()
        plans, analyses = [], []
        try:
            batched = self._decode_image_batches(job) if self.image_decoder is not None else {}
            for index, ref in enumerate(job.media):
                source = ref.path if ref.path is not None else ref.data
                if ref.kind == "image" and self.image_decoder is not None:
                    outcome = batched[index]
                    if isinstance(outcome, BaseException):
                        raise outcome  # reported below as this media's error, in input order
                    grid, job.patches[index], job.decode_s[index], job.decode_start[index] = outcome
                    plans.append(protocol.MediaPlan("image", tuple(grid)))
                    continue
                if ref.kind == "image":
                    t0 = time.perf_counter()
                    min_pixels, max_pixels = self._image_pixels(ref)
                    image = decode_image(source, min_pixels=min_pixels, max_pixels=max_pixels,
                                         max_image_pixels=self.config.max_image_source_pixels)
                    patches, grid = image.to_patches(self.spec)
                    job.patches[index] = patches
                    job.decode_s[index] = time.perf_counter() - t0
                    job.decode_start[index] = time.time() - job.decode_s[index]
                    plans.append(protocol.MediaPlan("image", tuple(grid)))
                    continue
                options = SamplingOptions(fps=ref.fps, max_frames=ref.max_frames, min_pixels=ref.min_pixels,
                                          max_pixels=ref.max_pixels)
                known = self.probes.get(ref.key)
                analysis = self.engine.analyse_bitstream(Source.of(source), options, info=known)
                analyses.append((index, analysis))  # the engine keeps it until decoded or cancelled
                if known is None:
                    self.probes.put(ref.key, analysis.info)
                duration = analysis.info.duration_s
                if duration > self.config.max_video_seconds:
                    raise ValueError(f"video {index} is {duration:.0f} s long; this server accepts at most "
                                     f"{self.config.max_video_seconds:.0f} s (--max-video-seconds)")
                plan = analysis.plan
                t, h, w = plan.grid_thw(self.spec.patch_size, self.spec.temporal_patch_size)
                plans.append(protocol.MediaPlan("video", (t, h, w), self.spec.temporal_patch_size / plan.sample_fps,
                                                plan.num_frames, float(duration)))
        except Exception as e:
            # the request fails at this media: the engine forgets the videos analysed so far (each holds its
            # source, an inline video's bytes whole), which nothing would decode or cancel later
            for _, analysis in analyses:
                self.engine.cancel(analysis.key_id)
            ref = job.media[len(plans)]
            if isinstance(e, (FlashCodecError, ValueError, OSError)):
                message = f"media {len(plans)}: {_one_line(e, ref)}"
            else:  # a decoder bug must not take the process down: fail this request only
                log.exception("probing request %s failed", job.request_id)
                message = f"media {len(plans)} could not be read: {_one_line(e, ref)}"
            self.events.put(("failed", job.request_id, message, None))
            return
        self.events.put(("probed", job.request_id, plans, time.perf_counter() - start, analyses))

    def _image_pixels(self, ref: protocol.MediaRef) -> tuple[int, int]:
        """``(min_pixels, max_pixels)`` of an image: the request's, else the model's, within the server's cap."""
        min_pixels = ref.min_pixels or self.image_pixels[0]
        max_pixels = ref.max_pixels or self.image_pixels[1]
        if ref.pixel_ceiling is not None:  # the model's defaults may exceed the server's cap
            max_pixels = min(max_pixels, ref.pixel_ceiling)
            min_pixels = min(min_pixels, max_pixels)
        return min_pixels, max(min_pixels, max_pixels)

    def _decode_image_batches(self, job: _Job) -> dict[int, tuple | BaseException]:
        """Decode the request's images on :attr:`image_decoder`, one batch per pixel budget, and cut them
        into patches of the buffer's dtype where they were decoded (the buffer's GPU).

        Returns, per image index, ``(grid, patches, decode_s, decode_start)`` or the exception its decode
        raised. ``decode_s`` runs from its batch's start until its patches were made, ``decode_start`` is
        that start (``time.time()``). A batch that fails is decoded again one image at a time, up to its
        first failing image, which names the failure; its images after that one are left out (the
        request fails at or before it).
        """
        groups: dict[tuple[int, int], list[int]] = {}  # (min_pixels, max_pixels) -> image indices, in order
        for index, ref in enumerate(job.media):
            if ref.kind == "image":
                groups.setdefault(self._image_pixels(ref), []).append(index)
        out: dict[int, tuple | BaseException] = {}
        for (min_pixels, max_pixels), indices in groups.items():
            sources = [job.media[i].path if job.media[i].path is not None else job.media[i].data for i in indices]
            t0, wall_start = time.perf_counter(), time.time()
            try:
                images = self.image_decoder.decode(sources, min_pixels=min_pixels, max_pixels=max_pixels,
                                                   max_image_pixels=self.config.max_image_source_pixels)
            except Exception:  # the batch names its first bad image by its source, not its index
                images = []
                for index, source in zip(indices, sources):
                    try:
                        images += self.image_decoder.decode([source], min_pixels=min_pixels, max_pixels=max_pixels,
                                                            max_image_pixels=self.config.max_image_source_pixels)
                    except Exception as e:
                        out[index] = e
                        break
            for index, image in zip(indices, images):
                try:
                    patches, grid = image.to_patches(self.spec, dtype=self.patch_buffer.dtype)
                except Exception as e:
                    out[index] = e
                    break
                out[index] = (grid, patches, time.perf_counter() - t0, wall_start)
        return out

    def _decode(self, job: _Job, index: int, analysis) -> None:
        start = time.perf_counter()
        try:
            self.engine.add_decoding_request(analysis.key_id, output="patches", patch_spec=self.spec,
                                             patch_dtype=self.patch_buffer.dtype, trace=decode_trace_enabled())
            decoded = self.engine.get_decoding_output(analysis.key_id)
            if decoded.trace is not None:
                self._log_trace(job, index, decoded.trace, time.perf_counter() - start, None)
        except DecodeCancelledError:  # the request went away, or core already has this media
            self.events.put(("cancelled", job.request_id))
            return
        except OutputTooLargeError:  # this process's memory now, not the client's media: 503, no figures shown
            self.events.put(("failed", job.request_id, f"media {index}: the server has no memory for this video's "
                             f"decoded frames now; retry later, or ask for fewer or smaller frames", index, 503))
            return
        except Exception as e:  # corrupt data, unsupported stream: the client's media, not our crash
            self.events.put(("failed", job.request_id, f"media {index}: {_one_line(e, job.media[index])}", index))
            return
        self.events.put(("decoded", job.request_id, index, decoded.patches, time.perf_counter() - start, time.time()))

    def _decode_streamed(self, job: _Job, index: int, analysis) -> None:
        """Decode a video as a FlashCodec stream: each new prefix of whole temporal slices becomes a "part"
        event (its patch rows), the last one marked so."""
        ended = False  # the last part went out: that ended this decode for the loop (a late cancel is moot)
        start, first_part = time.perf_counter(), None
        try:
            self.engine.add_decoding_request(analysis.key_id, output="patches", patch_spec=self.spec, stream=True,
                                             patch_dtype=self.patch_buffer.dtype, trace=decode_trace_enabled())
            for part in self.engine.stream_decoding_output(analysis.key_id):
                first_part = time.perf_counter() - start if first_part is None else first_part
                if part.trace is not None:  # the last part: logged before the loop thread hears of it
                    self._log_trace(job, index, part.trace, time.perf_counter() - start, first_part)
                self.events.put(("part", job.request_id, index, part.start, part.patches, part.decode_s, time.time(),
                                 part.is_last))
                ended = part.is_last
        except DecodeCancelledError:
            if not ended:
                self.events.put(("cancelled", job.request_id))
        except Exception as e:
            if not ended:
                self.events.put(("failed", job.request_id, f"media {index}: {_one_line(e, job.media[index])}", index))

    def _log_trace(self, job: _Job, index: int, events, wall_s: float, first_part_s: float | None) -> None:
        """One line per traced video (``UNIFIEDSERVE_DECODE_TRACE=1``); never fails the decode."""
        try:
            line = describe_trace(trace_summary(events, wall_s, rank_slots(self.engine)))
        except Exception as e:  # a diagnosis must not cost the request
            line = f"(no summary: {first_line(e)})"
        first = "" if first_part_s is None else f", first part out at {first_part_s:.3f} s"
        log.info("decode trace: request %s media %d (%s%s): %s", job.request_id, index,
                 "streamed" if first_part_s is not None else "whole", first, line)


def _one_line(e: BaseException, ref: protocol.MediaRef | None = None) -> str:
    """The first line of an error, naming the media as the client did: the resolved path (which may be a
    symlink's target) never reaches the client."""
    line = first_line(e)
    if ref is not None and ref.path:
        line = line.replace(ref.path, ref.shown or "the media file")
    return line
