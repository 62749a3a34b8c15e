"""The ``pyav`` backend, the CPU rank's default (:func:`flashcodec.decode.cpu.get_backend`): software decode
through PyAV (FFmpeg) with one FFmpeg thread per decoder slot; the GIL is released inside FFmpeg.

A segment decoder seeks to its segment's first packet (or demuxes forward to it when it is close), decodes up to
the segment's stop, skips frames that are neither targets nor references where that is exact
(:data:`NONREF_SKIP_CODECS`), and converts only target frames (:func:`convert_frame`, per the ``resize`` mode).
"""

from __future__ import annotations

import logging

import av
from av.video.codeccontext import VideoCodecContext
import numpy as np
import torch

from flashcodec import orientation
from flashcodec.decode.backends import Backend, Emit, SegmentDecoder, ShouldStop, never, reorder_depth
from flashcodec.plan.sampling import MAX_FRAME_PIXELS
from flashcodec.plan.segments import GopSegment
from flashcodec._errors import CorruptVideoError
from flashcodec._probe import SKIP_STREAM_INFO_DECODE, VideoInfo, open_input, per_probe, untimed_message
from flashcodec.resize import DEFAULT_RESIZE_MODE, check_resize_mode, resize_frames_uint8
from flashcodec.source import Source

log = logging.getLogger(__name__)


#: swscale filter of the ``"fast"`` mode's single colour-convert + resize. AREA is as close to an
#: antialiased bicubic resize (what qwen-vl-utils does) as swscale's BICUBIC (mean |diff| 1.48 vs
#: 1.51 on 720p -> 392x728) and 2.7x cheaper (3.1 ms vs 8.4 ms a frame on this project's CI machine).
DEFAULT_INTERPOLATION = "AREA"

#: Codecs whose FFmpeg decoders skip exactly the unreferenced frames under skip_frame=NONREF
#: (verified bit-exact by tests); others (e.g. libdav1d for AV1) may drop needed frames.
NONREF_SKIP_CODECS = frozenset({"h264", "hevc", "mpeg4"})

#: Forward gaps up to this many packets are skipped by demuxing (cheap) instead of seeking.
MAX_DEMUX_SKIP_PACKETS = 600


def rotate_display(frame: np.ndarray, rotation: int, mirror: bool = False) -> np.ndarray:
    """Turn a stored-orientation ``[H, W, 3]`` frame into display orientation: ``rotation`` counter-clockwise
    degrees, then a left-right mirror (:mod:`flashcodec.orientation`)."""
    return orientation.to_display(frame, rotation, mirror)


def stored_size(info: VideoInfo, height: int, width: int) -> tuple[int, int]:
    """The conversion size in stored orientation for a display-orientation output size."""
    return (width, height) if info.rotation in (90, 270) else (height, width)


def convert_frame(frame: av.VideoFrame, height: int, width: int, resize: str = DEFAULT_RESIZE_MODE,
                  interpolation: str = DEFAULT_INTERPOLATION) -> np.ndarray:
    """A decoded frame as uint8 ``[height, width, 3]`` RGB in stored orientation.

    ``"exact"``: full-resolution RGB first (swscale, the frame's colour matrix and range), then
    torch's uint8 antialiased bicubic resize (:func:`~flashcodec.resize.resize_frames_uint8`).
    ``"fast"``: one swscale call converting at the output size with ``interpolation``.
    """
    if resize == "fast":
        return frame.to_ndarray(width=width, height=height, format="rgb24", interpolation=interpolation)
    rgb = torch.from_numpy(frame.to_ndarray(format="rgb24"))  # [H0, W0, 3] at the stored size
    small = resize_frames_uint8(rgb.permute(2, 0, 1).unsqueeze(0), height, width)  # [1, 3, h, w] channels-last
    return small[0].permute(1, 2, 0).numpy()  # [h, w, 3], contiguous


def decoder_pixel_limit(max_source_pixels: int) -> int:
    """FFmpeg's ``max_pixels`` for a decoder under a cap of ``max_source_pixels`` stored pixels: FFmpeg checks it
    against the picture's padded size (its width aligned up for SIMD, 50x48 counts as 64x48), so a picture within
    the cap must pass it; a quarter over the cap covers any padding of a picture of 256x256 or more (smaller
    pictures are far under any cap), and still refuses a picture that grew far past it."""
    return max(max_source_pixels + max_source_pixels // 4, 1 << 16)


#: ``av.open`` options per codec for a segment decoder's open (a request opens one per CPU thread at once): H.264's
#: stream-info pass decodes no picture (:data:`flashcodec._probe.SKIP_STREAM_INFO_DECODE`), and the reorder depth
#: it would have guessed comes from our probe (:func:`reorder_depth`). Other codecs' opens decode nothing already.
FAST_OPEN_OPTIONS = {"h264": SKIP_STREAM_INFO_DECODE}
_HAS_REORDER_DEPTH = hasattr(VideoCodecContext, "reorder_depth")  # the setter is not in every PyAV the pin allows
#: The most pictures an H.264 decoder holds back (its DPB: 16 frames). A probe whose timestamps ask for more (they
#: run backwards: the file's, not the codec's) gets FFmpeg's own open: told to hold more, FFmpeg's H.264 decoder
#: fails an assertion and aborts the whole process (h264_slice.c, ``pics <= H264_MAX_DPB_FRAMES``).
MAX_REORDER_DEPTH = 16


@per_probe  # a 2-hour video's dict (216,000 frames) alone took 50 ms here
def pts_index(info: VideoInfo) -> tuple[np.ndarray, dict[int, int], np.ndarray, frozenset[int]]:
    """``(pts_by_position, display_by_pts, display_by_position, shared_pts)`` of a probe: decode position -> pts,
    pts -> display index, decode position -> display index, and the pts that two or more frames share (a broken
    muxer's file; their display order is their decode order; empty in a sound file). Shared by every segment
    decoder of the video (read-only)."""
    pts_by_position = np.empty(info.num_frames, dtype=np.int64)
    pts_by_position[info.decode_positions] = info.frame_pts
    pts_by_position.flags.writeable = False
    display_by_position = np.argsort(info.decode_positions)
    display_by_position.flags.writeable = False
    pts = info.frame_pts  # display order: equal pts are neighbours
    shared = frozenset(pts[1:][np.diff(pts) == 0].tolist()) if info.shared_pts else frozenset()
    return pts_by_position, {int(p): i for i, p in enumerate(pts.tolist())}, display_by_position, shared


class PyAVSegmentDecoder(SegmentDecoder):
    """Software decode through PyAV (FFmpeg), one FFmpeg thread; the GIL is released inside FFmpeg."""

    def __init__(self, source: Source, info: VideoInfo, height: int, width: int,
                 resize: str = DEFAULT_RESIZE_MODE, interpolation: str = DEFAULT_INTERPOLATION,
                 convert: bool = True, max_source_pixels: int = MAX_FRAME_PIXELS):
        self._resize = check_resize_mode(resize)
        self._max_pixels = decoder_pixel_limit(max_source_pixels)
        self._source = source
        self._info = info
        self._convert = convert  # False only to measure pure decode time (bench/decode's floor)
        self._open()
        self._out_h, self._out_w = stored_size(info, height, width)
        self._interpolation = interpolation
        # shared by the video's decoders
        self._pts_by_position, self._display_by_pts, self._display_by_position, self._shared_pts = pts_index(info)
        self._may_skip = info.codec in NONREF_SKIP_CODECS

    def _open(self) -> None:
        """Open the container and the stream's decoder, nothing demuxed yet (again: see :meth:`_seek_to`)."""
        depth = reorder_depth(self._info)
        fast = FAST_OPEN_OPTIONS.get(self._info.codec) if _HAS_REORDER_DEPTH and depth <= MAX_REORDER_DEPTH else None
        self._container = open_input(self._source.open(), fast)
        self._stream = self._container.streams[self._info.stream_index]
        self._context = self._stream.codec_context
        self._context.thread_count = 1  # parallelism comes from GOP segments, not FFmpeg threads
        # the probe checked the header's picture size; a stream may change size midway (a transport stream can),
        # and FFmpeg then allocates whatever the new pictures ask for (12000x12000 ones decoded at 1.3 GB): past
        # the engine's cap, its decoder refuses to allocate, and those pictures count as corrupt
        self._context.options = {**self._context.options, "max_pixels": str(self._max_pixels)}
        if fast:  # the stream-info pass guessed no depth (it decoded nothing): ours, never less than FFmpeg's
            self._context.reorder_depth = max(self._context.reorder_depth, depth)
        self._skip = "DEFAULT"
        self._packets = None  # demux iterator, positioned at self._position
        self._position = -1

    def _seek_to(self, position: int) -> None:
        """Position the demuxer at the packet of decode position ``position`` (a keyframe's, or the stream's first).

        A seek that fails (a raw H.264 stream has no index to seek by; an MP4 stream that starts mid-GOP has no
        keyframe at or before its first packet) or lands past the packet (Matroska seeks to its next keyframe) falls
        back to demuxing from the start of a fresh open. Where frames share the packet's pts, that pts names no one
        packet: it is not sought, and the packets are counted instead (from the start, or from the demuxer's place).
        A packet whose pts is its own is sought in such a file too (counting from the start for every segment made
        decoding a long file quadratic).

        Raises:
            CorruptVideoError: the packet is not in the stream, from the start either (timestamps the probe read
                differently).
        """
        target_pts = int(self._pts_by_position[position])
        count = target_pts in self._shared_pts
        if self._packets is not None and 0 <= self._position <= position <= self._position + MAX_DEMUX_SKIP_PACKETS:
            # close ahead: skip packets by demuxing only
            if self._scan_to(position, target_pts, count_from=self._position if count else None):
                return
        elif not count:
            try:
                self._container.seek(target_pts, backward=True, any_frame=False, stream=self._stream)
            except av.error.FFmpegError as e:
                log.debug("seek to pts %d failed (%s): demuxing from the start", target_pts, e)
            else:
                self._packets = self._container.demux(self._stream)
                if self._scan_to(position, target_pts, after_seek=True):
                    return
        self._container.close()
        self._open()
        self._packets = self._container.demux(self._stream)
        if not self._scan_to(position, target_pts, count_from=0 if count else None):
            self._packets, self._position = None, -1
            if self._untimed:  # the probe refuses such streams at their first packet; a file that changed since
                raise CorruptVideoError(untimed_message(self._source.name))
            raise CorruptVideoError(f"{self._source.name}: the packet at decode position {position} (pts {target_pts}) "
                                    f"is not in the stream; its timestamps or index are broken")

    def _scan_to(self, position: int, target_pts: int, after_seek: bool = False, count_from: int | None = None) -> bool:
        """Demux up to the packet whose pts (else dts) is ``target_pts`` and hold it as the next one to decode;
        ``count_from``: instead, the decode position of the demuxer's next packet, from which packets are counted.

        ``after_seek``: the demuxer was just seeked, and may have landed past the packet (Matroska seeks to the next
        keyframe when none is at or before it): a packet the probe placed after ``position`` ends the search at
        once, rather than demuxing the rest of the file for a packet behind it. (Only there: from the start of the
        stream, two packets with one pts, which a broken file can have, must not end the search early.)"""
        self._position = -1  # unknown until the packet is found (also if the demuxer raises here)
        self._untimed = False
        for packet in self._packets:
            if packet.size == 0:
                continue
            if count_from is not None:
                if count_from == position:
                    self._position, self._pending = position, packet
                    return True
                count_from += 1
                continue
            pts = packet.pts if packet.pts is not None else packet.dts
            self._untimed |= pts is None
            if pts == target_pts:
                self._position = position
                self._pending = packet
                return True
            if after_seek and pts is not None and pts not in self._shared_pts:  # a shared pts names no one frame
                display = self._display_by_pts.get(pts)
                if display is not None and int(self._info.decode_positions[display]) > position:
                    return False
        return False

    def decode_segment(self, segment: GopSegment, emit: Emit, should_stop: ShouldStop = never) -> list[int]:
        targets = set(segment.target_indices)
        # Frames that are neither targets nor references of later frames need not be decoded at
        # all: the decoder skips them (skip_frame=NONREF) and every other frame stays bit-exact.
        target_positions = {int(self._info.decode_positions[t]) for t in targets} if self._may_skip else None
        if self._position != segment.start_position:
            self._context.flush_buffers()
            self._seek_to(segment.start_position)
        else:
            self._pending = None
        position = segment.start_position
        packet = self._pending
        packets = self._packets
        try:
            while position <= segment.stop_position:
                if should_stop():  # cancelled: stop at this packet; the next segment seeks afresh
                    self._context.flush_buffers()
                    self._packets, self._position, self._pending = None, -1, None
                    return sorted(targets)
                if packet is None:
                    packet = next(packets)
                    if packet.size == 0:
                        packet = None
                        continue
                skip = "DEFAULT" if target_positions is None or position in target_positions else "NONREF"
                if skip != self._skip:
                    self._context.skip_frame = self._skip = skip
                # the packet's pts becomes its decode position, which its frame carries out of the decoder: a frame
                # is placed by it even where frames share a pts
                packet.pts = position
                self._decode_packet(packet, targets, emit)
                packet = None
                position += 1
            self._decode_packet(None, targets, emit)  # drain the reorder delay
        except StopIteration:  # truncated stream: what was decoded stands, the rest is reported
            self._decode_packet(None, targets, emit)
            self._packets, position = None, -1
        self._context.flush_buffers()
        self._position = position
        return sorted(targets)

    def _decode_packet(self, packet, targets: set[int], emit: Emit) -> None:
        try:
            frames = self._context.decode(packet)
        except (av.error.InvalidDataError, av.error.EOFError, ValueError) as e:
            log.debug("decode error at decode position %s: %s", getattr(packet, "pts", None), e)
            return
        for frame in frames:
            position = frame.pts  # the decode position decode_segment gave its packet
            display = (int(self._display_by_position[position])
                       if position is not None and 0 <= position < len(self._display_by_position) else None)
            if display is None or display not in targets or frame.is_corrupt:
                continue  # a corrupt target stays in `targets` and is reported as failed
            if not self._convert:
                emit(display, None)
                targets.discard(display)
                continue
            rgb = convert_frame(frame, self._out_h, self._out_w, self._resize, self._interpolation)  # [H, W, 3]
            emit(display, rotate_display(rgb, self._info.rotation, self._info.mirror))
            targets.discard(display)

    def close(self) -> None:
        self._container.close()


class PyAVBackend(Backend):
    """``max_source_pixels``: the engine's cap, which its decoders also hold pictures to that a stream grows to
    midway (:func:`decoder_pixel_limit`; the probe checks the header's size)."""

    name = "pyav"

    def __init__(self, max_source_pixels: int = MAX_FRAME_PIXELS):
        self.max_source_pixels = max_source_pixels

    def prepare(self, info):
        pts_index(info)
        reorder_depth(info)

    def open(self, source, info, height, width, resize=DEFAULT_RESIZE_MODE):
        return PyAVSegmentDecoder(source, info, height, width, resize, max_source_pixels=self.max_source_pixels)
