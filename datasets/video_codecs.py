"""Which encoders ``synthetic_video.make_video`` drives, which containers take them, and how.

:data:`CODECS` and :data:`CONTAINERS` list the combinations that were
verified to round-trip through PyAV; :func:`codec_options` gives each encoder
a regular GOP (a keyframe every ``gop`` frames, no scene cuts, a fixed
B-run); :func:`check_video_args` turns an unsupported request into a
``ValueError`` before anything is encoded.
"""

from __future__ import annotations

__all__ = ["BFRAME_CODECS", "CODECS", "CONTAINERS", "check_video_args", "codec_options"]

#: codec name -> PyAV/FFmpeg encoder name
CODECS = {
    "h264": "libx264",
    "hevc": "libx265",
    "vp9": "libvpx-vp9",
    "av1": "libsvtav1",
    "mpeg4": "mpeg4",
}

#: file suffix -> (FFmpeg muxer name, codecs it accepts).  Only combinations
#: that were verified to round-trip through PyAV are listed.
CONTAINERS = {
    ".mp4": ("mp4", frozenset({"h264", "hevc", "vp9", "av1", "mpeg4"})),
    ".mov": ("mov", frozenset({"h264", "hevc", "mpeg4"})),
    ".mkv": ("matroska", frozenset({"h264", "hevc", "vp9", "av1", "mpeg4"})),
    ".webm": ("webm", frozenset({"vp9", "av1"})),
    ".avi": ("avi", frozenset({"h264", "mpeg4"})),
}

#: Containers that can carry a display matrix (rotation).
_ROTATION_CONTAINERS = frozenset({".mp4", ".mov", ".mkv", ".webm"})
#: Codecs for which B-frames / open GOP can be requested.
BFRAME_CODECS = frozenset({"h264", "hevc", "mpeg4"})
_OPEN_GOP_CODECS = frozenset({"h264", "hevc", "mpeg4"})
#: codec -> (the encoder's parameter option, what its parameters add to the common ones)
_X26X_PARAMS = {"h264": ("x264-params", ""), "hevc": ("x265-params", ":log-level=error")}


def codec_options(
    codec: str, *, gop: int, bframes: int, open_gop: bool, preset: str | int | None
) -> dict[str, str]:
    """Encoder options for a regular GOP of ``gop`` frames with fixed B-runs of ``bframes``.

    ``preset``: the encoder's speed preset, None for its default.
    """
    opts: dict[str, str] = {}
    if codec in _X26X_PARAMS:  # x264 and x265 take the same GOP parameters
        key, extra = _X26X_PARAMS[codec]
        if preset is not None:
            opts["preset"] = str(preset)
        opts[key] = (
            f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes={bframes}"
            f":open-gop={int(open_gop)}:b-adapt=0{extra}"
        )
    elif codec == "vp9":
        opts.update({"crf": "32", "b": "0", "keyint_min": str(gop)})
        if preset is not None:
            p = str(preset)
            if p in ("realtime", "good", "best"):
                opts["deadline"] = p
            else:
                opts["cpu-used"] = p
        opts["row-mt"] = "1"
    elif codec == "av1":
        if preset is not None:
            opts["preset"] = str(preset)
        opts["svtav1-params"] = f"keyint={gop}:scd=0"
    elif codec == "mpeg4":
        opts["sc_threshold"] = "1000000000"  # no scene-cut keyframes
        if not open_gop:
            opts["flags"] = "+cgop"
    return opts


def check_video_args(codec, suffix, width, height, gop, bframes, vfr, rotation, open_gop, mirror=False):
    """Raise ``ValueError`` saying what to change if ``make_video`` cannot write these arguments."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {sorted(CODECS)}")
    if suffix not in CONTAINERS:
        raise ValueError(
            f"unsupported container suffix {suffix!r}; choose one of {sorted(CONTAINERS)}"
        )
    if codec not in CONTAINERS[suffix][1]:
        ok = sorted(s for s, (_, cs) in CONTAINERS.items() if codec in cs)
        raise ValueError(f"codec {codec!r} cannot be stored in {suffix!r}; use one of {ok}")
    if width <= 0 or height <= 0 or width % 2 or height % 2:
        raise ValueError(f"width/height must be positive and even, got {width}x{height}")
    if width < 16 or height < 16:  # (libx265 rejects 8x8; the code cells need room)
        raise ValueError(f"width/height must be at least 16, got {width}x{height}")
    if gop < 1:
        raise ValueError(f"gop must be >= 1, got {gop}")
    if bframes < 0:
        raise ValueError(f"bframes must be >= 0, got {bframes}")
    if bframes and codec not in BFRAME_CODECS:
        raise ValueError(f"{codec} has no B-frames; use bframes=0")
    if bframes and bframes >= gop:
        raise ValueError(f"bframes ({bframes}) must be smaller than gop ({gop})")
    if open_gop and codec not in _OPEN_GOP_CODECS:
        raise ValueError(f"open_gop is only supported for {sorted(_OPEN_GOP_CODECS)}")
    if rotation not in (0, 90, 180, 270):
        raise ValueError(f"rotation must be 0, 90, 180 or 270, got {rotation}")
    if (rotation or mirror) and suffix not in _ROTATION_CONTAINERS:
        raise ValueError(f"{suffix} cannot store rotation metadata")
    if vfr and suffix == ".avi":
        raise ValueError("AVI cannot store variable frame rate; use .mp4/.mkv/.mov/.webm")

