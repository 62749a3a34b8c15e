"""What the NVDEC engines of a GPU can decode: ``cuvidGetDecoderCaps`` through ctypes.

The driver answers per (codec, chroma format, bit depth): supported or not, how many NVDEC
engines can run it, and the largest coded size. flashcodec asks before sending a video to NVDEC
ranks, so that what the hardware cannot do (AV1 on A100/H100/H200, H.264 4:4:4) goes to CPU ranks
with a reason instead of failing mid-decode.

Only ``libcuda.so.1`` (the driver) and ``libnvcuvid.so.1`` (the video decoder, shipped with the
driver) are needed; no CUDA toolkit, no torch. Every query creates nothing that outlives it: the
device's primary context is retained, made current for the call, and released.

The structure layout and enum values are those of ``cuviddec.h`` in NVIDIA's Video Codec SDK
(``CUVIDDECODECAPS``, ``cudaVideoCodec``, ``cudaVideoChromaFormat``).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["CHROMA_FORMATS", "CODECS", "DecoderCaps", "NvcuvidError", "decoder_caps", "num_gpus"]

#: cudaVideoCodec values for the codecs FFmpeg names (``VideoInfo.codec``).
CODECS = {"mpeg1video": 0, "mpeg2video": 1, "mpeg4": 2, "vc1": 3, "h264": 4, "mjpeg": 5,
          "hevc": 8, "vp8": 9, "vp9": 10, "av1": 11}
#: cudaVideoChromaFormat values.
CHROMA_FORMATS = {"400": 0, "420": 1, "422": 2, "444": 3}


class NvcuvidError(RuntimeError):
    """The driver or the video-decoder library is missing, or a driver call failed."""


class _CUVIDDECODECAPS(ctypes.Structure):
    _fields_ = [
        ("eCodecType", ctypes.c_int),          # in
        ("eChromaFormat", ctypes.c_int),       # in
        ("nBitDepthMinus8", ctypes.c_uint),    # in
        ("reserved1", ctypes.c_uint * 3),
        ("bIsSupported", ctypes.c_ubyte),      # out
        ("nNumNVDECs", ctypes.c_ubyte),        # out: engines that can run this configuration
        ("nOutputFormatMask", ctypes.c_ushort),
        ("nMaxWidth", ctypes.c_uint),
        ("nMaxHeight", ctypes.c_uint),
        ("nMaxMBCount", ctypes.c_uint),
        ("nMinWidth", ctypes.c_ushort),
        ("nMinHeight", ctypes.c_ushort),
        ("bIsHistogramSupported", ctypes.c_ubyte),
        ("nCounterBitDepth", ctypes.c_ubyte),
        ("nMaxHistogramBins", ctypes.c_ushort),
        ("reserved3", ctypes.c_uint * 10),
    ]


@dataclass(frozen=True)
class DecoderCaps:
    """The driver's answer for one (codec, chroma format, bit depth) on one GPU."""

    codec: str
    chroma_format: str
    bit_depth: int
    is_supported: bool
    num_engines: int  # NVDEC engines that can decode this configuration
    max_width: int
    max_height: int
    max_macroblocks: int  # coded width * height / 256 must not exceed this
    min_width: int
    min_height: int

    def fits(self, width: int, height: int) -> bool:
        """Whether a coded ``width x height`` picture is within the engine's limits."""
        return (self.is_supported and self.min_width <= width <= self.max_width
                and self.min_height <= height <= self.max_height
                and (width * height) // 256 <= self.max_macroblocks)


_lock = threading.Lock()


@lru_cache(maxsize=1)
def _libraries() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise NvcuvidError(f"the NVIDIA driver library libcuda.so.1 cannot be loaded ({e})") from None
    try:
        nvcuvid = ctypes.CDLL("libnvcuvid.so.1")
    except OSError as e:
        raise NvcuvidError(f"the NVIDIA video decoder library libnvcuvid.so.1 cannot be loaded ({e})") from None
    _check(cuda, cuda.cuInit(0), "cuInit")
    return cuda, nvcuvid


def _check(cuda: ctypes.CDLL, status: int, call: str) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(status, ctypes.byref(name))
        raise NvcuvidError(f"{call} failed: {name.value.decode() if name.value else status}")


def _symbol(lib: ctypes.CDLL, *names: str):
    for name in names:  # versioned entry points first (the driver keeps both)
        if hasattr(lib, name):
            return getattr(lib, name)
    raise NvcuvidError(f"the driver lacks {names[0]}")


def num_gpus() -> int:
    """CUDA devices the driver sees (0 when there is no driver)."""
    try:
        cuda, _ = _libraries()
    except NvcuvidError:
        return 0
    count = ctypes.c_int()
    _check(cuda, cuda.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    return count.value


@lru_cache(maxsize=None)
def decoder_caps(codec: str, chroma_format: str = "420", bit_depth: int = 8, device: int = 0) -> DecoderCaps:
    """Ask the driver what NVDEC on GPU ``device`` can do for one configuration (cached).

    Args:
        codec: FFmpeg's codec name (``h264``, ``hevc``, ``av1``, ``vp9``, ...).
        chroma_format: ``"400" | "420" | "422" | "444"``.
        bit_depth: 8, 10 or 12.
        device: CUDA device ordinal.
    Returns:
        :class:`DecoderCaps`; ``is_supported`` is False for a codec NVDEC has no entry for.
    Raises:
        NvcuvidError: no driver or no ``libnvcuvid``, a bad device ordinal, or a failed driver call.
        ValueError: an unknown chroma format or a bit depth outside 8..16.
    """
    if chroma_format not in CHROMA_FORMATS:
        raise ValueError(f"chroma_format must be one of {', '.join(CHROMA_FORMATS)}, got {chroma_format!r}")
    if not 8 <= bit_depth <= 16:
        raise ValueError(f"bit_depth must be in 8..16, got {bit_depth}")
    if codec not in CODECS:
        return DecoderCaps(codec, chroma_format, bit_depth, False, 0, 0, 0, 0, 0, 0)
    cuda, nvcuvid = _libraries()
    if not 0 <= device < num_gpus():
        raise NvcuvidError(f"there is no CUDA device {device} ({num_gpus()} visible)")
    caps = _CUVIDDECODECAPS(eCodecType=CODECS[codec], eChromaFormat=CHROMA_FORMATS[chroma_format],
                            nBitDepthMinus8=bit_depth - 8)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    release = _symbol(cuda, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease")
    with _lock:  # the context push/pop pair must not interleave with another query on this thread
        _check(cuda, cuda.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        _check(cuda, cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        try:
            _check(cuda, _symbol(cuda, "cuCtxPushCurrent_v2", "cuCtxPushCurrent")(ctx), "cuCtxPushCurrent")
            try:
                _check(cuda, nvcuvid.cuvidGetDecoderCaps(ctypes.byref(caps)), "cuvidGetDecoderCaps")
            finally:
                popped = ctypes.c_void_p()
                _symbol(cuda, "cuCtxPopCurrent_v2", "cuCtxPopCurrent")(ctypes.byref(popped))
        finally:
            release(dev)
    return DecoderCaps(codec, chroma_format, bit_depth, bool(caps.bIsSupported), int(caps.nNumNVDECs),
                       int(caps.nMaxWidth), int(caps.nMaxHeight), int(caps.nMaxMBCount),
                       int(caps.nMinWidth), int(caps.nMinHeight))
