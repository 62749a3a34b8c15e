"""The CPU rank's backends, chosen by name (:func:`get_backend`): ``pyav``, the default
(:mod:`flashcodec.decode.pyav`), and ``torchcodec`` (here), which leaves to PyAV what it would misplace or
cannot open.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from flashcodec import orientation
from flashcodec.decode import fast_open
from flashcodec.decode.backends import Backend, Emit, SegmentDecoder, ShouldStop, never, reorder_depth
from flashcodec.decode.frame_mappings import frame_mappings
from flashcodec.decode.pyav import PyAVBackend, PyAVSegmentDecoder
from flashcodec.devices import log_once
from flashcodec.plan.sampling import MAX_FRAME_PIXELS
from flashcodec.plan.segments import GopSegment
from flashcodec._errors import CorruptVideoError, first_line
from flashcodec._probe import VideoInfo
from flashcodec.resize import DEFAULT_RESIZE_MODE, check_resize_mode, resize_frames_uint8
from flashcodec.source import Source

log = logging.getLogger(__name__)


class TorchCodecSegmentDecoder(SegmentDecoder):
    """Software decode through torchcodec, seeded with our probe's frame table (no second scan)."""

    def __init__(self, source: Source, info: VideoInfo, height: int, width: int,
                 resize: str = DEFAULT_RESIZE_MODE):
        fast_open.install()
        from torchcodec.decoders import VideoDecoder
        from torchcodec.transforms import Resize

        # exact: torchcodec converts at full resolution and we resize; fast: its own Resize transform
        self._resize_to = (height, width) if check_resize_mode(resize) == "exact" else None
        # torchcodec turns frames by the angle FFmpeg reads from the display matrix, blind to a mirror: the rest
        # of the display transform is done here (for a mirror only; a turn it made is the whole one)
        self._info = info
        self._turned = orientation.ffmpeg_rotation(info.rotation, info.mirror)

        try:
            with fast_open.opening(info, reorder_depth(info)):
                self._decoder = VideoDecoder(
                    source.path if source.path is not None else source.data,
                    stream_index=info.stream_index,
                    dimension_order="NHWC",
                    num_ffmpeg_threads=1,
                    custom_frame_mappings=frame_mappings(info),
                    transforms=[] if self._resize_to else [Resize((height, width))],
                )
        except (ValueError, RuntimeError) as e:  # e.g. a raw stream: "The maximum pts value in seconds is unknown"
            raise CorruptVideoError(f"{source.name}: torchcodec cannot open the video ({first_line(e)})") from e

    def _to_output(self, frames: torch.Tensor) -> np.ndarray:
        """``[N, H0, W0, 3]`` decoded frames (turned by FFmpeg's angle) -> ``[N, H, W, 3]`` at the output size, in
        display orientation."""
        if self._info.mirror:  # the turn to undo and the mirror: before the resize, whose size is the display's
            frames = orientation.to_display(frames, self._info.rotation, True, axes=(1, 2), turned=self._turned)
        if self._resize_to is None:
            return frames.contiguous().numpy()
        small = resize_frames_uint8(frames.permute(0, 3, 1, 2), *self._resize_to)  # [N, 3, H, W] channels-last
        return small.permute(0, 2, 3, 1).numpy()

    def decode_segment(self, segment: GopSegment, emit: Emit, should_stop: ShouldStop = never) -> list[int]:
        indices = list(segment.target_indices)
        if should_stop():
            return indices
        try:
            batch = self._decoder.get_frames_at(indices)
        except RuntimeError as e:  # torchcodec reports decode failures as RuntimeError
            log.debug("torchcodec failed on segment %s: %s", segment, e)
            return self._one_by_one(indices, emit)
        for display, frame in zip(indices, self._to_output(batch.data)):
            emit(display, frame)
        return []

    def _one_by_one(self, indices: list[int], emit: Emit) -> list[int]:
        failed = []
        for display in indices:
            try:
                frame = self._decoder.get_frame_at(display).data  # [H0, W0, 3]
                emit(display, self._to_output(frame.unsqueeze(0))[0])
            except RuntimeError:
                failed.append(display)
        return failed


class TorchCodecBackend(Backend):
    """Frames that share a pts (:attr:`VideoInfo.shared_pts`) are decoded by PyAV instead: torchcodec's seeks
    return the frame next to the one asked for there, silently. So is a video torchcodec cannot open that PyAV's
    probe read (torchcodec 0.13 opened no MPEG-TS file: "FrameDims.height must be > 0")."""

    name = "torchcodec"

    def prepare(self, info):
        if not info.shared_pts:
            frame_mappings(info)

    def open(self, source, info, height, width, resize=DEFAULT_RESIZE_MODE):
        if info.shared_pts:
            log_once(f"{source.name}: frames share timestamps, which torchcodec misplaces; decoding it with PyAV")
            return PyAVSegmentDecoder(source, info, height, width, resize)
        try:
            return TorchCodecSegmentDecoder(source, info, height, width, resize)
        except CorruptVideoError as e:  # a file that no longer opens at all fails in PyAV's open too, saying why
            log_once(f"{first_line(e)}; decoding it with PyAV")
            return PyAVSegmentDecoder(source, info, height, width, resize)


BACKENDS: dict[str, type[Backend]] = {"pyav": PyAVBackend, "torchcodec": TorchCodecBackend}
#: The default CPU backend, chosen by bench/decode (see docs/benchmarks.md).
DEFAULT_BACKEND = "pyav"


def available_backends() -> list[str]:
    names = ["pyav"]
    try:
        fast_open.install()
        import torchcodec.decoders  # noqa: F401

        names.append("torchcodec")
    except Exception:  # torchcodec raises OSError/RuntimeError when FFmpeg libraries are missing
        pass
    return names


def get_backend(name: str, max_source_pixels: int = MAX_FRAME_PIXELS) -> Backend:
    """The CPU backend ``name`` (``"auto"``: the default); a PyAV one holds its decoders to ``max_source_pixels``
    (torchcodec's FFmpeg takes no decoder options from here: its pictures are checked from the header only)."""
    if name == "auto":
        name = DEFAULT_BACKEND
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(['auto', *BACKENDS])}")
    if name == "torchcodec" and name not in available_backends():  # importing torchcodec is slow: only here
        raise ValueError(f"backend {name!r} is not usable here: install it with `pip install torchcodec` "
                         "and the system FFmpeg libraries")
    return PyAVBackend(max_source_pixels) if name == "pyav" else BACKENDS[name]()
