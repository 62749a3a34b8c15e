"""FlashCodec: GOP-parallel decoding of the frames a vision-language model needs.

Quick use::

    import flashcodec
    video = flashcodec.decode_video("clip.mp4")          # Qwen2.5-VL sampling: 2 fps, <= 768 frames
    video.frames                                          # uint8 [T, 3, H, W]
    flashcodec.decode_video("clip.mp4", output="patches").patches   # [N, 1176] model-ready
    flashcodec.decode_video("clip.mp4", device="cuda").frames       # NVDEC; the frames stay on the GPU
"""

import importlib

from flashcodec._errors import (
    CorruptVideoError,
    DecodeCancelledError,
    FlashCodecError,
    NoFramesError,
    NotAVideoError,
    OutputTooLargeError,
    SourceNotFoundError,
    UnsupportedCodecError,
    VideoTooLargeError,
)

# Everything else is imported on first use: `flashcodec --help` and `import flashcodec` then cost
# neither torch nor PyAV until a name that needs them is touched. (The probe lives in `_probe`, so
# that importing that module never replaces the package's `probe` function with the module.)
_EXPORTS = {
    "available_backends": "decode.cpu", "BitstreamAnalysis": "decode.request", "DecodedVideo": "decode.request",
    "DecodedSlice": "decode.request",
    "DecodeEngine": "decode.engine", "decode_video": "decode.shared_engine", "default_engine": "decode.shared_engine",
    "DeviceError": "devices", "DecodedImage": "image", "ImageDecodeError": "image", "decode_image": "image",
    "decode_images": "image_batch", "SamplingOptions": "plan.sampling", "VideoPlan": "plan.video",
    "plan_video": "plan.video", "Gop": "_probe", "VideoInfo": "_probe", "probe": "_probe",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashcodec' has no attribute {name!r}")
    return getattr(importlib.import_module(f"flashcodec.{_EXPORTS[name]}"), name)


def analyse_bitstream(source, **options):
    """Probe and plan ``source`` on the default engine; returns its key id, info and plan (a ``BitstreamAnalysis``)."""
    return __getattr__("default_engine")().analyse_bitstream(source, **options)


def add_decoding_request(key_id: int, **options) -> None:
    """Queue an analysed video for decoding on the default engine."""
    __getattr__("default_engine")().add_decoding_request(key_id, **options)


def get_decoding_output(key_id: int | None = None, timeout: float | None = None):
    """Block (GIL released) until a request on the default engine is decoded; return its ``DecodedVideo``."""
    return __getattr__("default_engine")().get_decoding_output(key_id, timeout)


__version__ = "0.1.0"

__all__ = [
    "BitstreamAnalysis", "CorruptVideoError", "DecodeCancelledError", "DecodeEngine", "DecodedImage", "DecodedSlice",
    "DecodedVideo", "DeviceError", "ImageDecodeError",
    "FlashCodecError", "Gop",
    "NoFramesError", "NotAVideoError", "SamplingOptions", "SourceNotFoundError", "UnsupportedCodecError",
    "VideoInfo", "VideoPlan", "VideoTooLargeError", "add_decoding_request", "analyse_bitstream", "available_backends",
    "decode_image", "decode_images", "decode_video", "default_engine", "get_decoding_output", "plan_video", "probe",
]
