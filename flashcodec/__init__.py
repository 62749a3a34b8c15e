"""FlashCodec: GOP-parallel decoding of the frames a vision-language model needs.

Quick use::

    import flashcodec
    video = flashcodec.decode_video("clip.mp4")          # Qwen2.5-VL sampling: 2 fps, <= 768 frames
    video.frames                                          # uint8 [T, 3, H, W]
    flashcodec.decode_video("clip.mp4", output="patches").patches   # [N, 1176] model-ready
    flashcodec.decode_video("clip.mp4", device="cuda").frames       # NVDEC; the frames stay on the GPU
"""

from flashcodec._errors import (
    CorruptVideoError,
    FlashCodecError,
    NoFramesError,
    NotAVideoError,
    SourceNotFoundError,
    UnsupportedCodecError,
)
from flashcodec.decode.backends import available_backends
from flashcodec.decode.engine import (
    BitstreamAnalysis,
    DecodedVideo,
    DecodeEngine,
    decode_video,
    default_engine,
)
from flashcodec.devices import DeviceError
from flashcodec.image import DecodedImage, ImageDecodeError, decode_image
from flashcodec.plan.sampling import SamplingOptions
from flashcodec.plan.video import VideoPlan, plan_video
from flashcodec.probe import Gop, VideoInfo, probe


def analyse_bitstream(source, **options) -> BitstreamAnalysis:
    """Probe and plan ``source`` on the default engine; returns its key id, info and plan."""
    return default_engine().analyse_bitstream(source, **options)


def add_decoding_request(key_id: int, **options) -> None:
    """Queue an analysed video for decoding on the default engine."""
    default_engine().add_decoding_request(key_id, **options)


def get_decoding_output(key_id: int | None = None, timeout: float | None = None) -> DecodedVideo:
    """Block (GIL released) until a request on the default engine is decoded; return it."""
    return default_engine().get_decoding_output(key_id, timeout)


__version__ = "0.1.0"

__all__ = [
    "BitstreamAnalysis", "CorruptVideoError", "DecodeEngine", "DecodedImage", "DecodedVideo", "DeviceError", "ImageDecodeError",
    "FlashCodecError", "Gop",
    "NoFramesError", "NotAVideoError", "SamplingOptions", "SourceNotFoundError", "UnsupportedCodecError",
    "VideoInfo", "VideoPlan", "add_decoding_request", "analyse_bitstream", "available_backends",
    "decode_image", "decode_video", "default_engine", "get_decoding_output", "plan_video", "probe",
]
