"""One decode request's state, and what the engine (:mod:`flashcodec.decode.engine`) hands back for it.

:class:`BitstreamAnalysis` is what a probe and plan learned; :class:`DecodeRequest` collects a queued request's
frames from every rank (each rank's rows written in place as its decoder threads emit them) and assembles the
output, or, streamed, tracks how long its final prefix is; :class:`DecodedVideo` is a whole request's output,
:class:`DecodedSlice` the next part of a streamed one. :func:`check_output_memory` refuses, before it is queued, a
request whose whole output this process has no memory left for.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from flashcodec._errors import CorruptVideoError, OutputTooLargeError
from flashcodec._probe import VideoInfo
from flashcodec.decode.rank_job import RankJob, SlotEvent
from flashcodec.plan.video import VideoPlan
from flashcodec.source import Source

__all__ = ["BitstreamAnalysis", "DecodeRequest", "DecodedSlice", "DecodedVideo", "check_output_memory", "output_bytes",
           "wait_until"]


@dataclass(frozen=True, eq=False)
class BitstreamAnalysis:
    """What ``analyse_bitstream`` learned: enough to count tokens before decoding anything."""

    key_id: int
    info: VideoInfo
    plan: VideoPlan
    probe_s: float
    source: Source = field(repr=False)
    allowed_ranks: frozenset[int] | None = None  # ranks that may decode it (None: all)


@dataclass(eq=False)
class DecodedVideo:
    """A decoded request. ``frames`` holds the padded output (a multiple of the temporal patch)."""

    key_id: int
    #: uint8 [T, 3, H, W], RGB, display orientation; channels-last in memory (as torchcodec's
    #: NCHW output), call ``.contiguous()`` if a kernel needs NCHW-contiguous memory.
    frames: torch.Tensor | None
    patches: torch.Tensor | None  # float32 [grid_t*grid_h*grid_w, 3*2*14*14], Qwen2.5-VL layout
    grid_thw: tuple[int, int, int]
    frame_indices: list[int]  # display indices of the sampled frames (before padding)
    sample_fps: float
    info: VideoInfo
    failed_frame_indices: list[int]  # targets that could not be decoded (see on_corrupt)
    probe_s: float
    decode_s: float
    #: with ``add_decoding_request(..., trace=True)``: every decoder open and segment decode of the request,
    #: in the order they ended (:class:`~flashcodec.decode.rank_job.SlotEvent`, times from the queueing)
    trace: list[SlotEvent] | None = None

    @property
    def frame_times_s(self) -> list[float]:
        times = self.info.frame_times_s
        return [float(times[i]) for i in self.frame_indices]

    def __repr__(self) -> str:
        out = (f"frames=uint8{list(self.frames.shape)}" if self.frames is not None
               else f"patches=float32{list(self.patches.shape)}")
        return (f"DecodedVideo(key_id={self.key_id}, {out}, grid_thw={self.grid_thw}, "
                f"num_frames={len(self.frame_indices)}, sample_fps={self.sample_fps:.3f}, "
                f"failed={len(self.failed_frame_indices)}, decode_s={self.decode_s:.3f})")


@dataclass(frozen=True, eq=False)
class DecodedSlice:
    """The next part of a streamed request's output (``add_decoding_request(..., stream=True)``).

    Rows ``[start, stop)`` of what :class:`DecodedVideo` would hold: frames for ``output="rgb"``,
    patch rows of whole temporal patches for ``output="patches"``. Parts come in display order and
    without gaps; the last one has ``stop == num_rows``.
    """

    key_id: int
    start: int
    stop: int
    num_rows: int  # rows of the whole output (padded frames, or grid_t * grid_h * grid_w patch rows)
    #: uint8 [stop - start, 3, H, W], as ``DecodedVideo.frames`` (channels-last in memory)
    frames: torch.Tensor | None
    patches: torch.Tensor | None  # float32 [stop - start, 3*2*14*14], Qwen2.5-VL layout
    grid_thw: tuple[int, int, int]  # of the whole video
    decode_s: float  # since the request was queued
    #: the last part of a request queued with ``trace=True``: as ``DecodedVideo.trace``, every slot's work whole
    trace: list[SlotEvent] | None = None

    @property
    def is_last(self) -> bool:
        return self.stop == self.num_rows

    def __repr__(self) -> str:
        out = (f"frames=uint8{list(self.frames.shape)}" if self.frames is not None
               else f"patches=float32{list(self.patches.shape)}")
        return (f"DecodedSlice(key_id={self.key_id}, rows [{self.start}, {self.stop}) of {self.num_rows}, {out}, "
                f"decode_s={self.decode_s:.3f})")


def output_bytes(plan, output: str, patch_dtype: torch.dtype = torch.float32) -> int:
    """Host memory a whole decode's output takes at its peak: the uint8 RGB frames, and for ``"patches"`` the
    patches too (both are alive while the frames are cut into patches)."""
    pixels = plan.num_output_frames * plan.height * plan.width
    return pixels * 3 + (pixels * 3 * patch_dtype.itemsize if output == "patches" else 0)


def check_output_memory(plan, output: str, patch_dtype: torch.dtype = torch.float32) -> None:
    """Refuse, before decoding, a whole output larger than the memory this process can still take (the kernel's
    available memory, or a container's limit: :func:`flashcodec._sysmem.available_memory`). Against the machine's
    whole memory, an output just under it ran the machine out; unchecked, the library allocated 193 GB and failed
    inside a decoder thread.

    Raises:
        OutputTooLargeError: naming the size and the options that shrink it.
    """
    from flashcodec._sysmem import available_memory

    need = output_bytes(plan, output, patch_dtype)
    found = available_memory()
    if found is not None and need > found[0]:
        memory, what = found
        raise OutputTooLargeError(
            f"the output would take {need / 2**30:.1f} GiB ({plan.num_output_frames} frames of {plan.height}x"
            f"{plan.width}, {output}), more than this machine's {memory / 2**30:.1f} GiB of {what}; lower "
            f"max_pixels, the size, fps or max_frames (--max-pixels, --size, --fps, --max-frames)")


def wait_until(cond: threading.Condition, deadline: float | None, timeout: float | None) -> None:
    """``cond.wait()`` (held) until notified or ``deadline`` (``time.monotonic()``; None: no limit).

    Raises:
        TimeoutError: the deadline has passed (``timeout`` is the caller's, for the message).
    """
    remaining = None if deadline is None else deadline - time.monotonic()
    if remaining is not None and remaining <= 0:
        raise TimeoutError(f"decoding did not finish within {timeout} s")
    cond.wait(remaining)


class DecodeRequest:
    """Collects one request's frames from every rank and assembles the output when all finish.

    A rank's output ``[T_rank, H, W, 3]`` is allocated when that rank emits its first frame, and
    decoder threads copy each converted frame straight into its row. Requests waiting in the
    queue hold no frame memory (the point of allocating late, paper §3.4), and no frame is copied
    twice: first-touching a fresh buffer at the end would add a serial pass over all output
    memory (1.5 s for 600 frames of 392x728 on the 2-core CI machine).

    A streamed request (``stream=True``) is never assembled: it tracks which output rows are final
    (a frame written, or its rank finished: repeated and padding frames) and the length of the
    final prefix, ``num_ready`` frames, waking :meth:`DecodeEngine.stream_decoding_output` as it
    grows; that reader frees each rank's buffer once it has handed out all of its rows.
    """

    def __init__(self, analysis: BitstreamAnalysis, output: str, on_corrupt: str, patch_spec,
                 progress: Callable[[int, int], None] | None, done: Callable[["DecodeRequest"], None],
                 device: torch.device = torch.device("cpu"), stream: bool = False,
                 patch_dtype: torch.dtype = torch.float32, trace: bool = False):
        self.analysis = analysis
        self.patch_dtype = patch_dtype
        self.stream = stream
        self.device = device  # where the output lives; GPU ranks' frames never leave their GPU
        self.output = output
        self.on_corrupt = on_corrupt
        self.patch_spec = patch_spec
        self.progress = progress
        self._done = done
        self.failed: set[int] = set()
        self.produced: set[int] = set()  # display indices written to their rows
        self.rank_outputs: dict[int, torch.Tensor] = {}
        # display index -> its (rank, row) places; a repeated frame may sit on both sides of a rank boundary
        self._rows: dict[int, list[tuple[int, int]]] = {}
        self.rank_start: list[int] = []  # first output row (frame) of each rank
        start = 0
        for rank in analysis.plan.ranks:
            self.rank_start.append(start)
            start += rank.num_output_frames
            for row, display in enumerate(rank.frame_indices):
                self._rows.setdefault(display, []).append((rank.rank, row))
        self.num_frames = start  # output frames, padding included
        self.released: set[int] = set()  # ranks whose buffers a streamed reader has freed
        self.changed = threading.Condition()  # streamed: num_ready grew, or the request ended
        self._final = bytearray(self.num_frames)  # streamed: 1 where an output row is final
        self.num_ready = 0  # streamed: rows [0, num_ready) are final
        self.finished = False
        self.cancelled = False
        self.abandoned = False  # streamed: its reader went away before the end
        self.errors: list[BaseException] = []
        self.ranks_left = len(analysis.plan.ranks)
        self.cost_done = 0
        self.started = time.perf_counter()
        self.trace: tuple[float, list[SlotEvent]] | None = (self.started, []) if trace else None
        self.result: DecodedVideo | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def _rank_buffer(self, rank: int) -> torch.Tensor | None:
        out = self.rank_outputs.get(rank)
        if out is None:
            with self._lock:
                out = self.rank_outputs.get(rank)
                if out is None:
                    if rank in self.released:  # streamed out already: a late duplicate has nowhere to go
                        return None
                    plan = self.analysis.plan
                    n = plan.ranks[rank].num_output_frames
                    out = self.rank_outputs[rank] = torch.empty((n, plan.height, plan.width, 3), dtype=torch.uint8,
                                                                device=self.device)  # [T_rank, H, W, 3]
        return out

    def emit(self, display: int, frame: np.ndarray | torch.Tensor) -> None:
        """Called by decoder threads with a ``[H, W, 3]`` uint8 frame at the output size: a numpy
        array from CPU ranks, a tensor on its GPU from NVDEC ranks (copied device to device)."""
        places = self._rows[display]
        for rank, row in places:
            buffer = self._rank_buffer(rank)
            if buffer is None:
                continue
            if isinstance(frame, np.ndarray) and buffer.device.type == "cpu":
                buffer.numpy()[row] = frame
            elif isinstance(frame, np.ndarray):
                # a CPU rank's frame into a GPU output: queued, not waited for. Staged in page-locked memory first
                # (torch's pinned cache keeps the block until the copy has run): from pageable memory the driver
                # may wait for the stream, i.e. for every NVDEC rank's work queued on it, once per frame
                buffer[row].copy_(torch.from_numpy(frame).pin_memory(), non_blocking=True)
            else:
                buffer[row].copy_(frame)
        self.produced.add(display)
        if self.stream:
            self._mark_final([self.rank_start[rank] + row for rank, row in places])

    def emit_many(self, displays: list[int], frames: torch.Tensor) -> None:
        """``emit`` for a GPU rank's batch (``[n, H, W, 3]`` on its GPU, ``frames[i]`` is ``displays[i]``): one copy
        when the frames fill consecutive rows of one rank's buffer (a segment's targets, each sampled once), else
        one by one."""
        if not displays:
            return
        places = [self._rows[d] for d in displays]
        rank, first = places[0][0]
        if all(len(p) == 1 and p[0] == (rank, first + i) for i, p in enumerate(places)):
            buffer = self._rank_buffer(rank)
            if buffer is not None:
                buffer[first:first + len(displays)].copy_(frames)
                self.produced.update(displays)
                if self.stream:
                    start = self.rank_start[rank] + first
                    self._mark_final(range(start, start + len(displays)))
                return
        for display, frame in zip(displays, frames):
            self.emit(display, frame)

    def _mark_final(self, rows) -> None:
        """Streamed: these output rows hold their final pixels; grow the prefix and wake the reader."""
        with self.changed:
            for row in rows:
                self._final[row] = 1
            ready = self.num_ready
            while ready < self.num_frames and self._final[ready]:
                ready += 1
            if ready > self.num_ready:
                self.num_ready = ready
                self.changed.notify_all()

    def segment_done(self, segment, failed: list[int]) -> None:
        with self._lock:
            self.failed.update(failed)
            self.cost_done += segment.cost
            done = self.cost_done
        if self.progress is not None:
            self.progress(done, self.analysis.plan.decode_cost)

    def rank_finished(self, job: RankJob, error: BaseException | None) -> None:
        if error is None:
            try:
                self._complete_rank(job)
            except BaseException as e:
                error = e
        if error is None and self.stream:
            indices = job.plan.frame_indices
            if self.on_corrupt == "repeat" or not any(d in self.failed for d in indices):
                first = self.rank_start[job.plan.rank]  # lost frames are filled, padding is written
                self._mark_final(range(first, first + job.plan.num_output_frames))
        with self._lock:
            if error is not None:
                self.errors.append(error)
            self.ranks_left -= 1
            last = self.ranks_left == 0
        if last:
            self._finish()

    def _complete_rank(self, job: RankJob) -> None:
        """Fill lost frames (``on_corrupt="repeat"``) and the temporal-patch padding."""
        indices = list(job.plan.frame_indices)
        if not indices:
            return
        rows = self._rank_buffer(job.plan.rank)
        lost = [d for d in indices if d not in self.produced or d in self.failed]
        self.failed.update(lost)
        good = [d for d in indices if d not in self.failed]
        if lost and self.on_corrupt == "repeat" and good:
            for row, display in enumerate(indices):
                if display in self.failed:
                    nearest = min(good, key=lambda g: (abs(g - display), g))
                    rows[row] = rows[indices.index(nearest)]
        if job.plan.num_pad_frames:
            rows[len(indices):] = rows[len(indices) - 1]

    def _finish(self) -> None:
        a = self.analysis
        try:
            if self.errors:
                raise self.errors[0]
            failed = sorted(self.failed)
            if failed and (self.on_corrupt == "error" or len(failed) == a.plan.num_frames):
                shown = ", ".join(map(str, failed[:8])) + (" ..." if len(failed) > 8 else "")
                raise CorruptVideoError(
                    f"{a.source.name}: {len(failed)} of {a.plan.num_frames} sampled frames could not be decoded "
                    f"(display indices {shown}); the stream is corrupt or truncated there"
                    + ("" if len(failed) == a.plan.num_frames else "; use on_corrupt='repeat' to decode the rest"),
                    failed,
                )
            if not self.stream:  # a streamed reader has had the frames: only the outcome (error) is left
                grid = a.plan.grid_thw()
                for r in a.plan.ranks:
                    self._rank_buffer(r.rank)  # a rank with no frames still contributes an empty tensor
                outputs = [self.rank_outputs[r.rank] for r in a.plan.ranks]
                frames = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [T, H, W, 3]
                frames = frames.permute(0, 3, 1, 2)  # [T, 3, H, W], channels-last strides
                patches = None
                if self.output == "patches":
                    from flashcodec.patches import PatchSpec, frames_to_patches

                    patches, grid = frames_to_patches(frames, self.patch_spec or PatchSpec(), dtype=self.patch_dtype)
                    frames = None
                self.result = DecodedVideo(
                    key_id=a.key_id, frames=frames, patches=patches, grid_thw=tuple(grid),
                    frame_indices=list(a.plan.frame_indices), sample_fps=a.plan.sample_fps, info=a.info,
                    failed_frame_indices=failed, probe_s=a.probe_s, decode_s=time.perf_counter() - self.started,
                    trace=None if self.trace is None else list(self.trace[1]),
                )
        except BaseException as e:
            self.error = e
        if not self.stream:  # a streamed reader may be copying rows out; it drops the buffers itself
            self.rank_outputs.clear()
        self._done(self)
        self._end()

    def _end(self) -> None:
        with self.changed:
            self.finished = True
            self.changed.notify_all()

    def take_rows(self, start: int, stop: int) -> torch.Tensor:
        """Streamed: output frames ``[start, stop)`` (all final) as one ``[n, H, W, 3]`` tensor; frees
        the buffer of every rank whose last row this hands out."""
        parts = []
        for rank, first in enumerate(self.rank_start):
            last = first + self.analysis.plan.ranks[rank].num_output_frames
            lo, hi = max(start, first), min(stop, last)
            if lo < hi:
                parts.append(self._rank_buffer(rank)[lo - first:hi - first])
            if first < last <= stop:  # handed out to its end: never read again
                with self._lock:
                    self.released.add(rank)
                    self.rank_outputs.pop(rank, None)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

