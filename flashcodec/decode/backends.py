"""Decoder backends. A backend opens per-thread *segment decoders* for one video.

Contract: a :class:`SegmentDecoder` belongs to one thread and one video. ``decode_segment``
decodes packets ``start_position..stop_position`` and calls ``emit(display_index, frame)`` once
per target frame, with ``frame`` a uint8 ``[H, W, 3]`` RGB array already at the plan's output
size and in display orientation (a numpy array from CPU backends, a CUDA tensor on its GPU from
NVDEC). Non-target frames are decoded but never converted. It returns
the target indices it could not produce.

How a target frame becomes RGB at the output size is the ``resize`` mode (:mod:`flashcodec.resize`):
``"exact"`` converts it to full-resolution RGB (colour matrix and range from the frame's tags)
and resizes that with antialiased bicubic, as Qwen2.5-VL's reference pipeline does; ``"fast"``
converts and resizes in one swscale call at the output size.

Backends per decoder kind: ``pyav`` (:mod:`flashcodec.decode.pyav`) and ``torchcodec`` (CPU software decode,
:mod:`flashcodec.decode.cpu`), chosen by name for the CPU rank; and NVDEC
(:class:`flashcodec.decode.nvdec.NvdecBackend`, one per GPU rank), which engines create from their ``devices``, not
by name. Here: the interfaces they implement, and what their decoders share.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np
import torch

from flashcodec.plan.segments import GopSegment
from flashcodec._probe import VideoInfo, per_probe
from flashcodec.resize import DEFAULT_RESIZE_MODE
from flashcodec.source import Source

Emit = Callable[[int, "np.ndarray | torch.Tensor"], None]
ShouldStop = Callable[[], bool]


def emit_many(emit: Emit, displays: list[int], frames: torch.Tensor) -> None:
    """Hand a decoder's batch of frames (``[n, H, W, 3]``, display indices ``displays``) to ``emit``: in one call
    where ``emit`` takes batches (an ``emit.many(displays, frames)`` attribute, as the scheduler's has), else one
    frame at a time. For GPU frames a batch is one copy instead of ``n`` (each a few torch calls, every one giving
    up and taking back the GIL that a rank's other slots wait on)."""
    many = getattr(emit, "many", None)
    if many is not None:
        many(displays, frames)
        return
    for display, frame in zip(displays, frames):
        emit(display, frame)


def never() -> bool:
    """The ``should_stop`` of a segment nobody will cancel."""
    return False


class SegmentDecoder(ABC):
    @abstractmethod
    def decode_segment(self, segment: GopSegment, emit: Emit, should_stop: ShouldStop = never) -> list[int]:
        """Decode one GOP segment, calling ``emit`` per target frame; returns the targets it could not produce.

        ``should_stop`` is polled at every packet (or batch of frames): when it turns true the decoder
        stops there and returns (the request was cancelled; what it returns is then ignored), and the
        decoder stays usable for another segment.
        """

    def close(self) -> None:
        pass


class Backend(ABC):
    """A kind of decoder. ``device`` names the rank it runs on (``"cpu"`` here)."""

    name: str
    device: str = "cpu"

    @abstractmethod
    def open(self, source: Source, info: VideoInfo, height: int, width: int,
             resize: str = DEFAULT_RESIZE_MODE) -> SegmentDecoder:
        """A decoder of ``source`` emitting ``[height, width, 3]`` frames resized per ``resize``."""

    def prepare(self, info: VideoInfo) -> None:
        """Build, once per probe, what every decoder of this video derives from the probe when it opens (called
        when the video is planned): a request's slots then open at once without each waiting on the GIL for one
        thread's build of it."""


@per_probe
def reorder_depth(info: VideoInfo) -> int:
    """Frames a decoder must hold back to output this video in display order (FFmpeg's ``has_b_frames``): the
    most any frame's decode position runs ahead of its display index."""
    if info.num_frames == 0:
        return 0
    return max(0, int((info.decode_positions - np.arange(info.num_frames)).max()))

