"""NVDEC backend: GOP segments decoded on a GPU's hardware decoders, frames kept on that GPU.

One :class:`NvdecSegmentDecoder` is one NVDEC session: a torchcodec 0.16 ``VideoDecoder`` with
``device="cuda:N"`` (torchcodec's own NVDEC front end, measured to work from many threads of one
process on the primary context; PyAV's ``HWAccel`` decodes only in the main thread, see
docs/gpu.md). The driver spreads concurrent sessions over the GPU's NVDEC engines and one session
never uses more than one engine, so a rank of this backend runs 7-14 sessions as threads.

Frames never leave the GPU. torchcodec hands each decoded picture over as full-resolution RGB
``uint8 [N, 3, H, W]`` on the GPU, converted out of the decoder's surface at once (the surface
pool is only as deep as the DPB, so nothing holds a surface). Each chunk is resized there with
:func:`flashcodec.resize.resize_frames_on_device` (the reference antialiased bicubic, as one fused
kernel when Triton is installed: no float32 copy of the full-resolution frames), turned to display
orientation if torchcodec has not done so, and emitted as one ``[n, h, w, 3]`` GPU view per chunk that the
engine copies into the request's GPU output (one copy where the chunk's rows are consecutive).

Colour: torchcodec 0.16's CUDA path builds its YUV->RGB matrix from the stream's colour-space and
range tags (``compute_color_conversion_matrix(AVColorSpace, AVColorRange)`` in its library); this
module passes no colour options of its own.

Warm decoders: creating an NVDEC decoder costs tens of ms. torchcodec keeps released hardware
decoders in a per-GPU LRU cache (default 20, reused for the same codec and size);
:class:`NvdecBackend` raises that capacity to at least its session count, so when one video's
sessions close, the next video of the same codec and size reuses every one of them. The rank's
threads themselves live as long as the engine.

Ran on an H100 (docs/gpu.md, issue 12's table): the CPU tests cover the device-free logic, the ``cuda`` tests in
tests/flashcodec/decode/test_nvdec_cuda.py the rest.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from flashcodec import orientation
from flashcodec.decode import fast_open
from flashcodec.decode.backends import Backend, Emit, SegmentDecoder, ShouldStop, emit_many, never, reorder_depth
from flashcodec.devices import DEFAULT_NVDEC_SESSIONS, log_once
from flashcodec.plan.segments import GopSegment
from flashcodec.decode.frame_mappings import frame_mappings
from flashcodec._probe import VideoInfo
from flashcodec.resize import DEFAULT_RESIZE_MODE, check_resize_mode, resize_frames_on_device
from flashcodec.source import Source

log = logging.getLogger(__name__)

#: Full-resolution frames fetched per ``get_frames_at`` call: bounds a session's GPU memory (8
#: frames of 1080p RGB are 50 MB) while keeping calls few. Successive calls move forward in the
#: same GOP, which torchcodec decodes on without seeking.
FRAMES_PER_CALL = 8



def to_display(frames: torch.Tensor, info: VideoInfo) -> torch.Tensor:
    """Full-resolution ``[N, 3, H, W]`` frames in display orientation (a view when no turn is needed).

    torchcodec >= 0.16 turns frames by the angle FFmpeg reads from the display matrix, which misses a mirror
    (:mod:`flashcodec.orientation`): the rest of the transform is done here. A frame that still has the stored
    shape of a quarter-turned video was not turned at all.
    """
    turned = orientation.ffmpeg_rotation(info.rotation, info.mirror)
    if turned in (90, 270) and tuple(frames.shape[2:]) != (info.display_height, info.display_width):
        turned = 0
    return orientation.to_display(frames, info.rotation, info.mirror, axes=(2, 3), turned=turned)


class NvdecSegmentDecoder(SegmentDecoder):
    """One NVDEC session on one GPU for one video; used by one thread.

    ``decode_segment`` emits ``uint8 [h, w, 3]`` CUDA tensors (views; the engine copies them).
    Both resize modes give the reference resize here: ``"fast"`` exists to save CPU time, and on
    the GPU the reference resize costs little next to the decode.
    """

    def __init__(self, source: Source, info: VideoInfo, height: int, width: int, device_index: int,
                 resize: str = DEFAULT_RESIZE_MODE):
        fast_open.install()
        from torchcodec.decoders import VideoDecoder

        check_resize_mode(resize)
        self._info = info
        self._size = (height, width)
        self._device = torch.device("cuda", device_index)
        def open_session():
            return VideoDecoder(source.path if source.path is not None else source.data, stream_index=info.stream_index,
                                dimension_order="NCHW", device=str(self._device),
                                custom_frame_mappings=frame_mappings(info))

        with fast_open.opening(info, reorder_depth(info)) as fast:  # H.264: no software decode in FFmpeg's open
            self._decoder = open_session()
        # torchcodec 0.16's NVDEC interface knows at once whether it decodes on the CPU
        fallback = self._decoder.cpu_fallback
        if fallback and fast:  # was it the open without the decode? A full open says; the run goes on either way
            full = open_session()
            if not full.cpu_fallback:
                fast_open.give_up(f"an NVDEC session opened without it decoded on the CPU ({fallback}), a full "
                                  f"open on NVDEC")
                self._decoder, fallback = full, full.cpu_fallback
        if fallback:  # torchcodec decodes on the CPU and uploads: right frames, no NVDEC speed
            log_once(f"{source.name}: torchcodec decodes on the CPU instead of NVDEC on {self._device} ({fallback})")

    def decode_segment(self, segment: GopSegment, emit: Emit, should_stop: ShouldStop = never) -> list[int]:
        indices = list(segment.target_indices)
        failed: list[int] = []
        for start in range(0, len(indices), FRAMES_PER_CALL):
            if should_stop():  # cancelled: stop between batches
                return failed + indices[start:]
            chunk = indices[start:start + FRAMES_PER_CALL]
            try:
                frames = self._decoder.get_frames_at(chunk).data  # uint8 [n, 3, H0, W0] on the GPU
            except RuntimeError as e:  # torchcodec reports decode failures as RuntimeError
                log.debug("NVDEC failed on frames %s of %s: %s", chunk, segment, e)
                failed += self._one_by_one(chunk, emit)
                continue
            self._emit(chunk, frames, emit)
        return failed

    def _one_by_one(self, indices: Sequence[int], emit: Emit) -> list[int]:
        failed = []
        for display in indices:
            try:
                frame = self._decoder.get_frame_at(display).data  # uint8 [3, H0, W0]
            except RuntimeError:
                failed.append(display)
                continue
            self._emit([display], frame.unsqueeze(0), emit)
        return failed

    def _emit(self, indices: Sequence[int], frames: torch.Tensor, emit: Emit) -> None:
        frames = to_display(frames, self._info)  # [n, 3, H0, W0]
        small = resize_frames_on_device(frames, *self._size)  # [n, 3, h, w] on the same GPU
        emit_many(emit, list(indices), small.permute(0, 2, 3, 1))  # [n, h, w, 3] view

    def close(self) -> None:
        self._decoder = None  # returns the hardware decoder to torchcodec's per-GPU cache


class NvdecBackend(Backend):
    """NVDEC sessions on GPU ``device_index`` (a rank whose slots are concurrent sessions).

    Args:
        device_index: CUDA ordinal.
        num_sessions: the rank's slots; torchcodec's per-GPU decoder cache is raised to at least
            this, so every session's hardware decoder stays warm between videos.
    """

    name = "nvdec"

    def __init__(self, device_index: int, num_sessions: int = DEFAULT_NVDEC_SESSIONS):
        if device_index < 0 or num_sessions < 1:
            raise ValueError(f"need a CUDA ordinal >= 0 and >= 1 session, got {device_index}, {num_sessions}")
        self.device_index = device_index
        self.device = f"cuda:{device_index}"
        from torchcodec.decoders import get_nvdec_cache_capacity, set_nvdec_cache_capacity

        if get_nvdec_cache_capacity() < num_sessions:
            set_nvdec_cache_capacity(num_sessions)

    def prepare(self, info):
        frame_mappings(info)

    def open(self, source, info, height, width, resize=DEFAULT_RESIZE_MODE):
        return NvdecSegmentDecoder(source, info, height, width, self.device_index, resize)
