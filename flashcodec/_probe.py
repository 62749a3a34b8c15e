"""Demux-only scan of a video: metadata, per-frame timestamps and the GOP table, no full decode.

The scan reads every packet header of the video stream (what a container index would give) and
decodes exactly one packet, the first keyframe, to learn the display rotation and to fail early
on streams no decoder can read. Its cost is a small fraction of a full decode.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, TypeVar

import av
import numpy as np

from flashcodec._errors import (CorruptVideoError, NoFramesError, NotAVideoError, UnsupportedCodecError,
                                VideoTooLargeError, first_line)
from flashcodec.orientation import from_display_matrix
from flashcodec.source import Source, SourceLike


@dataclass(frozen=True)
class Gop:
    """A group of pictures: packets ``[start_position, end_position)`` in decode order."""

    index: int
    start_position: int  # decode-order position of the keyframe packet
    end_position: int  # exclusive
    keyframe_index: int  # display-order index of the keyframe

    @property
    def num_frames(self) -> int:
        return self.end_position - self.start_position


@dataclass(frozen=True, eq=False)
class VideoInfo:
    """What the probe learned about the video stream. Frame indices are display-order positions."""

    codec: str
    width: int  # stored (coded) size; see display_width/height for the rotated size
    height: int
    #: counter-clockwise degrees, 0/90/180/270, the display matrix turns the stored picture by (then ``mirror``);
    #: not FFmpeg's reading of a mirrored matrix (:mod:`flashcodec.orientation`)
    rotation: int
    pix_fmt: str | None
    time_base: Fraction
    average_fps: float
    duration_s: float
    num_frames: int
    header_num_frames: int | None  # what the container claimed; may be wrong or missing
    stream_index: int
    container_format: str
    #: int64 [num_frames]: pts of each frame, display order (ascending).
    frame_pts: np.ndarray = field(repr=False)
    #: int64 [num_frames]: decode-order packet position of each display-order frame.
    decode_positions: np.ndarray = field(repr=False)
    #: int64 [num_keyframes]: decode-order positions of the keyframe packets, ascending.
    keyframe_positions: np.ndarray = field(repr=False)
    #: streams in the container (all kinds), as FFmpeg's open counts them
    num_streams: int = 1
    #: the reorder depth (``has_b_frames``) a decoder starts with after an open whose stream-info pass decoded
    #: nothing (what FFmpeg learns without decoding: for MP4, off the composition offsets); None when the probe
    #: needed a full open or PyAV cannot say.
    #: Read by :mod:`flashcodec.decode.fast_open`.
    open_reorder_depth: int | None = None
    #: the display matrix mirrors the picture left-right after the rotation (:mod:`flashcodec.orientation`)
    mirror: bool = False

    @property
    def display_height(self) -> int:
        return self.width if self.rotation in (90, 270) else self.height

    @property
    def display_width(self) -> int:
        return self.height if self.rotation in (90, 270) else self.width

    @property
    def num_keyframes(self) -> int:
        return len(self.keyframe_positions)

    @property
    def keyframe_indices(self) -> list[int]:
        """Display-order indices of the keyframes."""
        order = np.argsort(self.decode_positions)  # decode position -> display index
        return [int(order[p]) for p in self.keyframe_positions]

    @property
    def gops(self) -> list[Gop]:
        order = np.argsort(self.decode_positions)
        ends = list(self.keyframe_positions[1:]) + [self.num_frames]
        return [
            Gop(i, int(s), int(e), int(order[s]))
            for i, (s, e) in enumerate(zip(self.keyframe_positions, ends))
        ]

    @property
    def frame_times_s(self) -> np.ndarray:
        """float64 [num_frames]: presentation time of each frame in seconds from the first."""
        return (self.frame_pts - self.frame_pts[0]).astype(np.float64) * float(self.time_base)

    @functools.cached_property  # asked at each decoder's open (14 NVDEC sessions, every CPU thread)
    def shared_pts(self) -> bool:
        """Whether two frames share a pts (a broken muxer's file): their display order is their decode order. Only
        the PyAV backend places such frames right (by decode position); torchcodec's seeks miss them."""
        return bool(np.any(np.diff(self.frame_pts) == 0))

    @property
    def is_vfr(self) -> bool:
        if self.num_frames < 3:
            return False
        deltas = np.diff(self.frame_pts)
        return bool(deltas.max() - deltas.min() > max(1, 0.01 * np.median(deltas)))

    def to_dict(self) -> dict:
        return {
            "codec": self.codec,
            "width": self.width,
            "height": self.height,
            "rotation": self.rotation,
            "mirror": self.mirror,
            "pix_fmt": self.pix_fmt,
            "time_base": str(self.time_base),
            "average_fps": self.average_fps,
            "duration_s": self.duration_s,
            "num_frames": self.num_frames,
            "header_num_frames": self.header_num_frames,
            "is_vfr": self.is_vfr,
            "container_format": self.container_format,
            "stream_index": self.stream_index,
            "num_keyframes": self.num_keyframes,
            "keyframe_indices": self.keyframe_indices,
            "frame_pts": self.frame_pts.tolist(),
        }


_T = TypeVar("_T")


def per_probe(build: Callable[[VideoInfo], _T]) -> Callable[[VideoInfo], _T]:
    """``build(info)`` once per probe, kept while the probe lives and shared by every thread (read it, never
    write it). For what a request's decoders all derive from the probe when they open: a request opens one
    per slot at once (14 NVDEC sessions per GPU, one per CPU thread), and for a long video each derivation is
    milliseconds of Python under the GIL."""
    cache: weakref.WeakKeyDictionary[VideoInfo, _T] = weakref.WeakKeyDictionary()
    lock = threading.Lock()

    @functools.wraps(build)
    def get(info: VideoInfo) -> _T:
        with lock:
            value = cache.get(info)
            if value is None:
                value = cache[info] = build(info)
        return value

    return get


#: ``av.open`` options that tell FFmpeg's stream-info pass to decode no picture. For H.264 that pass otherwise
#: decodes the first 7 or more in software only to guess the reorder depth (``has_b_frames``): 164 ms per open of
#: a 1080p clip on the development machine, against 0.4 ms for HEVC, and about 0.1 s on the H100 machine's host.
#: Used by the probe (below) and by PyAV's segment decoders (``decode.pyav.FAST_OPEN_OPTIONS``).
SKIP_STREAM_INFO_DECODE = {"skip_frame": "all"}
#: The probe's open, on every request's path. What it needs of a decoded picture (its pixel format and rotation)
#: comes from the first keyframe, which it decodes anyway; a stream whose size or codec that pass could not tell
#: without decoding is opened again without the option.
FAST_PROBE_OPTIONS = SKIP_STREAM_INFO_DECODE


# Tags are not UTF-8 in every file: a Latin-1 title made PyAV 18's open raise UnicodeDecodeError on a valid video.
# Nothing here reads them, so PyAV 18 is told to turn an undecodable byte into U+FFFD, as ffprobe shows it. PyAV 19
# dropped av.open's metadata_encoding/metadata_errors arguments (passing one raises TypeError: every open failed on
# the GPU machine's PyAV 19.0.2, 2026-11-28). 19 reads every tag as UTF-8 with surrogateescape (its changelog), and
# the Latin-1 title's test passed there.
def open_input(file, options: dict | None = None):
    """``av.open(file)`` for reading, with tags that are not UTF-8 read rather than refused (PyAV 18 and 19)."""
    tags = {"metadata_errors": "replace"} if int(av.__version__.split(".")[0]) < 19 else {}
    return av.open(file, mode="r", options=options, **tags)


def _open_container(source: Source, options: dict | None = None):
    try:
        return open_input(source.open(), options)
    except av.error.FFmpegError as e:
        raise NotAVideoError(f"{source.name}: not a readable video container ({_ffmpeg_reason(e)})") from None


def _stream_known(container) -> bool:
    """Whether the first video stream's codec and size came out of a stream-info pass that decoded nothing."""
    if not container.streams.video:
        return True  # nothing to learn by decoding: the probe reports it
    try:
        context = container.streams.video[0].codec_context
    except av.error.FFmpegError:
        return False
    return context is not None and bool(context.name) and context.width > 0 and context.height > 0


#: The most frames (packets) a video's stream may have: the probe scans every packet, and its index grows with them
#: (10M one-byte packets, a 70 MB file, took the probe 21 s and 755 MB and its decode past 60 s and 2.2 GB).
#: 2^21 is 19 hours at 30 fps.
MAX_VIDEO_FRAMES = 1 << 21


def untimed_message(name: str) -> str:
    """The refusal of a video whose packets carry no timestamps (the probe's, at its first such packet)."""
    return (f"{name}: its packets carry no timestamps (a raw H.264 or HEVC stream?); put it in a container first, "
            f"e.g. ffmpeg -i IN -c copy OUT.mp4")


def _ffmpeg_reason(e: Exception) -> str:
    return getattr(e, "strerror", None) or first_line(e)


def check_source_size(name: str, width: int, height: int, max_source_pixels: int | None) -> None:
    """Raise VideoTooLargeError when a video's stored pictures exceed ``max_source_pixels`` (None: no cap)."""
    if max_source_pixels is not None and width * height > max_source_pixels:
        raise VideoTooLargeError(f"{name}: its pictures are {width}x{height} ({width * height} pixels); at most "
                                 f"{max_source_pixels} are decoded (max_source_pixels)")


def probe(source: SourceLike | Source, max_source_pixels: int | None = None) -> VideoInfo:
    """Scan a video's packets and return its :class:`VideoInfo`.

    ``max_source_pixels``: refuse a video whose stored pictures are larger, from its header, before its packets are
    scanned and its first keyframe decoded (a 752-KB file of one 16000x16000 picture took 843 MB to refuse after).

    Raises:
        SourceNotFoundError: the path does not exist.
        NotAVideoError: not a container, or no video stream in it.
        UnsupportedCodecError: no decoder for the video codec.
        VideoTooLargeError: pictures over ``max_source_pixels``.
        NoFramesError: the video stream holds no frames.
        CorruptVideoError: the first keyframe cannot be decoded.
    """
    src = Source.of(source)
    try:
        container = _open_container(src, FAST_PROBE_OPTIONS) if FAST_PROBE_OPTIONS else None
    except NotAVideoError:
        container = None  # the full open below says why, or reads what this one could not
    if container is not None and not _stream_known(container):
        container.close()
        container = None
    fast = container is not None
    if container is None:
        container = _open_container(src)
    with container:
        if not container.streams.video:
            raise NotAVideoError(f"{src.name}: the container has no video stream")
        stream = container.streams.video[0]
        try:
            codec_context = stream.codec_context
            codec = codec_context.name if codec_context is not None else None
        except av.error.FFmpegError:
            codec = None
        if not codec:
            raise UnsupportedCodecError(f"{src.name}: no decoder available for this video stream's codec")
        check_source_size(src.name, int(codec_context.width), int(codec_context.height), max_source_pixels)
        open_depth = _stated_reorder_depth(codec_context) if fast else None  # before any decode raises it

        pts_list: list[int] = []
        keyframe_positions: list[int] = []
        first_keyframe = None
        last_duration = 0
        try:
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue  # the demuxer's end-of-stream marker
                pts = packet.pts if packet.pts is not None else packet.dts
                if pts is None:  # no frame of such packets could be placed in display order, nor sought
                    if not pts_list:  # from the first one on: a raw stream
                        raise CorruptVideoError(untimed_message(src.name))
                    raise CorruptVideoError(f"{src.name}: packet {len(pts_list)} of the video stream carries no "
                                            f"timestamp, so its frames cannot be placed; remux the file, e.g. "
                                            f"ffmpeg -fflags +genpts -i IN -c copy OUT.mp4")
                if len(pts_list) >= MAX_VIDEO_FRAMES:  # the scan's time and memory grow with the packets
                    raise VideoTooLargeError(f"{src.name}: the video stream has more than {MAX_VIDEO_FRAMES} frames; "
                                             f"flashcodec reads at most {MAX_VIDEO_FRAMES} (MAX_VIDEO_FRAMES)")
                if packet.is_keyframe:
                    keyframe_positions.append(len(pts_list))
                    if first_keyframe is None:
                        first_keyframe = packet
                pts_list.append(pts)
                last_duration = packet.duration or last_duration
        except av.error.FFmpegError as e:
            if not pts_list:
                raise CorruptVideoError(f"{src.name}: cannot read video packets ({_ffmpeg_reason(e)})") from None
            # A truncated tail: keep the packets read so far.

        if not pts_list:
            raise NoFramesError(f"{src.name}: the video stream has no frames")
        if not keyframe_positions or keyframe_positions[0] != 0:
            # The stream starts mid-GOP; decoding from packet 0 is the best anyone can do.
            keyframe_positions.insert(0, 0)

        rotation, mirror, keyframe_format = _first_frame_orientation(src, stream, first_keyframe)

        decode_pts = np.asarray(pts_list, dtype=np.int64)
        decode_positions = np.argsort(decode_pts, kind="stable")  # display index -> decode position
        frame_pts = decode_pts[decode_positions]
        time_base = stream.time_base or Fraction(1, 1)
        num_frames = len(frame_pts)
        duration_s = float((int(frame_pts[-1]) - int(frame_pts[0]) + (last_duration or 0)) * time_base)
        average_fps = _average_fps(stream, num_frames, duration_s)
        if duration_s <= 0:
            duration_s = num_frames / average_fps

        return VideoInfo(
            codec=codec,
            width=int(stream.codec_context.width),
            height=int(stream.codec_context.height),
            rotation=rotation,
            pix_fmt=stream.codec_context.pix_fmt or keyframe_format,
            time_base=Fraction(time_base),
            average_fps=average_fps,
            duration_s=duration_s,
            num_frames=num_frames,
            header_num_frames=int(stream.frames) or None,
            stream_index=stream.index,
            container_format=container.format.name,
            frame_pts=frame_pts,
            decode_positions=decode_positions.astype(np.int64),
            keyframe_positions=np.asarray(keyframe_positions, dtype=np.int64),
            num_streams=len(container.streams),
            open_reorder_depth=open_depth,
            mirror=mirror,
        )


def _stated_reorder_depth(codec_context) -> int | None:
    depth = getattr(codec_context, "reorder_depth", None)  # PyAV >= 15
    if depth is None:
        return None if codec_context.has_b_frames else 0
    return int(depth)


def _average_fps(stream, num_frames: int, duration_s: float) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if rate and float(rate) > 0 and math.isfinite(float(rate)):
        return float(rate)
    if duration_s > 0:
        return num_frames / duration_s
    return 1.0


def _first_frame_orientation(src: Source, stream, keyframe_packet) -> tuple[int, bool, str | None]:
    """Decode one keyframe packet; return its display ``(rotation, mirror)`` (:mod:`flashcodec.orientation`) and
    its pixel format."""
    if keyframe_packet is None:
        return 0, False, None
    context = stream.codec_context
    context.thread_count = 1
    try:
        frames = list(context.decode(keyframe_packet)) + list(context.decode(None))
    except av.error.FFmpegError as e:
        raise CorruptVideoError(f"{src.name}: the first keyframe cannot be decoded ({_ffmpeg_reason(e)})") from None
    if not frames:
        return 0, False, None
    rotation, mirror = frame_orientation(frames[0])
    return rotation, mirror, frames[0].format.name


def frame_orientation(frame: av.VideoFrame) -> tuple[int, bool]:
    """A decoded frame's display ``(rotation, mirror)``, from its display-matrix side data (the stream's, which
    FFmpeg attaches to every frame); without the matrix's bytes, the angle FFmpeg reads from it and no mirror."""
    side_data = getattr(frame, "side_data", ())
    for item in side_data:
        # PyAV 18 iterates the SideData objects; PyAV 19's container is a mapping whose keys are their types
        data = item if hasattr(item, "type") else side_data[item]
        kind = getattr(data.type, "name", str(data.type))
        if kind.endswith("DISPLAYMATRIX") and len(raw := bytes(data)) >= 36:
            return from_display_matrix(np.frombuffer(raw, dtype=np.int32, count=9).tolist())
    rotation = getattr(frame, "rotation", 0) or 0
    return int(round(rotation / 90.0)) * 90 % 360, False
