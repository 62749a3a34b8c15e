"""Media for the GPU decode benchmark, made where it runs: realistic 1080p clips and a JPEG batch.

Clips: YUV 4:2:0 frames synthesised with torch (on the GPU when there is one, so making a
2-minute 1080p clip costs seconds), encoded with PyAV at a target bit rate and a fixed GOP:
NVENC (``h264_nvenc`` / ``hevc_nvenc``) when the driver's encoder (``libnvidia-encode.so.1``)
opens, else libx264 / libx265. PyAV 19.0.2's manylinux wheel bundles all four (its libavcodec
names them; read from the wheel, not run here).
Clean test patterns decode unrealistically fast, so each frame has what camera footage has:

- a textured background (smooth gradients, coarse blotches, fine grain) panning on a circle,
- a second textured layer moving the other way, blended in (two motion fields per frame),
- fresh sensor noise every frame (sigma 3 levels in luma, 2 in chroma).

Clips are cached by their parameters; the encoder used and the measured bit rate are returned.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

#: Encoders tried per codec, the hardware one first.
ENCODERS = {"h264": ("h264_nvenc", "libx264"), "hevc": ("hevc_nvenc", "libx265")}


@dataclass(frozen=True)
class ClipSpec:
    codec: str  # h264 | hevc
    width: int
    height: int
    duration_s: float
    fps: int
    bitrate: int  # bits/s
    gop: int
    seed: int = 0

    @property
    def num_frames(self) -> int:
        return max(1, round(self.duration_s * self.fps))


@dataclass(frozen=True)
class Clip:
    path: Path
    spec: ClipSpec
    encoder: str
    measured_bitrate: float  # bits/s of the file over the clip's duration
    encode_s: float  # 0 when taken from the cache


class _Synth:
    """Frames as yuv420p planes ``uint8 [H*3/2, W]``; one textured world, two moving windows on it."""

    def __init__(self, width: int, height: int, seed: int, device: torch.device):
        self.w, self.h, self.device = width, height, device
        self.margin = m = max(8, min(width, height) // 8)
        g = torch.Generator(device="cpu").manual_seed(seed)
        wh, ww = height + 2 * m, width + 2 * m
        yy, xx = torch.meshgrid(torch.linspace(0, 1, wh), torch.linspace(0, 1, ww), indexing="ij")
        smooth = 110 + 50 * torch.sin(2 * math.pi * (1.3 * xx + 0.7 * yy)) + 30 * torch.cos(2 * math.pi * 2.1 * yy)
        coarse = F.interpolate(torch.randn(1, 1, wh // 8 + 1, ww // 8 + 1, generator=g) * 25, size=(wh, ww),
                               mode="bilinear", align_corners=False)[0, 0]
        fine = torch.randn(wh, ww, generator=g) * 10
        self.world = (smooth + coarse + fine).to(device)  # [wh, ww] luma of the scene
        self.layer = (torch.randn(wh // 4 + 1, ww // 4 + 1, generator=g) * 40).to(device)
        self.layer = F.interpolate(self.layer[None, None], size=(wh, ww), mode="bicubic",
                                   align_corners=False)[0, 0]  # [wh, ww] a second, smoother texture
        cy, cx = torch.meshgrid(torch.linspace(0, 1, wh // 2), torch.linspace(0, 1, ww // 2), indexing="ij")
        self.u = (128 + 40 * torch.sin(2 * math.pi * (0.9 * cx + 0.2 * cy))).to(device)  # [wh/2, ww/2]
        self.v = (128 + 40 * torch.cos(2 * math.pi * (0.3 * cx + 0.8 * cy))).to(device)
        self.gen = torch.Generator(device=device).manual_seed(seed + 1)

    def frame(self, i: int) -> np.ndarray:
        m, h, w = self.margin, self.h, self.w
        phase = 2 * math.pi * i / 240  # one circle every 8 s at 30 fps
        oy, ox = int(m + m * math.sin(phase)), int(m + m * math.cos(phase))
        ly, lx = int(m - m * math.sin(1.7 * phase)), int(m - m * math.cos(1.3 * phase))
        noise = torch.randn((h, w), generator=self.gen, device=self.device) * 3
        y = self.world[oy:oy + h, ox:ox + w] + 0.6 * self.layer[ly:ly + h, lx:lx + w] + noise  # [h, w]
        cy, cx, ch, cw = oy // 2, ox // 2, h // 2, w // 2
        chroma_noise = torch.randn((2, ch, cw), generator=self.gen, device=self.device) * 2
        u = self.u[cy:cy + ch, cx:cx + cw] + chroma_noise[0]  # [h/2, w/2]
        v = self.v[cy:cy + ch, cx:cx + cw] + chroma_noise[1]
        planes = torch.cat([y.reshape(-1), u.reshape(-1), v.reshape(-1)]).clamp_(0, 255).round_().to(torch.uint8)
        return planes.reshape(h * 3 // 2, w).cpu().numpy()  # yuv420p layout PyAV expects


def _open_stream(container, encoder: str, spec: ClipSpec):
    stream = container.add_stream(encoder, rate=spec.fps)
    stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
    cc = stream.codec_context
    cc.bit_rate = spec.bitrate
    cc.gop_size = spec.gop
    cc.time_base = Fraction(1, spec.fps)
    stream.time_base = Fraction(1, spec.fps)
    keyint = f"keyint={spec.gop}:min-keyint={spec.gop}:scenecut=0"
    if encoder.endswith("_nvenc"):
        cc.max_b_frames = 2
        stream.options = {"preset": "p4", "rc": "vbr", "maxrate": str(int(spec.bitrate * 1.2)),
                          "bufsize": str(spec.bitrate * 2)}
    elif encoder == "libx264":
        stream.options = {"preset": "veryfast", "x264-params": keyint}
    else:
        stream.options = {"preset": "ultrafast", "x265-params": keyint + ":log-level=error"}
    return stream


def _encode(path: Path, encoder: str, spec: ClipSpec, device: torch.device) -> None:
    import av

    synth = _Synth(spec.width, spec.height, spec.seed, device)
    with av.open(str(path), "w", format="mp4") as out:
        stream = _open_stream(out, encoder, spec)
        for i in range(spec.num_frames):
            frame = av.VideoFrame.from_ndarray(synth.frame(i), format="yuv420p")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


def make_clip(spec: ClipSpec, cache_dir: Path, device: torch.device | None = None) -> Clip:
    """Encode (or take from ``cache_dir``) a clip; the hardware encoder first, the software one if it fails.

    Raises:
        RuntimeError: no encoder of ``spec.codec`` works here (the message lists each one's error).
    """
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    for encoder in ENCODERS[spec.codec]:
        path = cache_dir / f"{spec.codec}-{spec.width}x{spec.height}-{key}-{encoder}.mp4"
        started = time.perf_counter()
        if not path.exists():
            tmp = path.with_suffix(".part.mp4")
            try:
                _encode(tmp, encoder, spec, device)
            except Exception as e:  # NVENC missing (no libnvidia-encode, no GPU) or an encoder error
                tmp.unlink(missing_ok=True)
                errors.append(f"{encoder}: {' '.join(str(e).split())[:200]}")
                continue
            tmp.rename(path)
        took = time.perf_counter() - started
        bitrate = path.stat().st_size * 8 / (spec.num_frames / spec.fps)
        return Clip(path, spec, encoder, bitrate, took)
    raise RuntimeError(f"no {spec.codec} encoder works here: " + "; ".join(errors))


def make_jpegs(count: int, width: int, height: int, seed: int = 0, quality: int = 90) -> list[bytes]:
    """``count`` baseline JPEGs of ``width x height`` with the clips' texture and noise (distinct frames)."""
    from PIL import Image

    synth = _Synth(width, height, seed, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    out = []
    for i in range(count):
        planes = synth.frame(i * 7)
        h, w = height, width
        y = planes[:h]
        u = planes[h:h + h // 4].reshape(h // 2, w // 2)
        v = planes[h + h // 4:].reshape(h // 2, w // 2)
        ycbcr = np.stack([y, u.repeat(2, 0).repeat(2, 1), v.repeat(2, 0).repeat(2, 1)], axis=-1)
        buf = io.BytesIO()
        Image.fromarray(ycbcr, "YCbCr").convert("RGB").save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out
