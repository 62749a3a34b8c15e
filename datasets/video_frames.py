"""The frames that ``synthetic_video.make_video`` encodes: when each is shown and what it shows.

:func:`frame_times` gives the presentation times (constant or seeded variable
frame rate).  :class:`FrameSynth` renders frame ``i`` into a yuv420p buffer:

* a smooth gradient + seeded noise texture that pans across the frame,
* a second, finer noise layer moving the other way (so that a single motion
  vector per block cannot predict the frame and the decoder does real work),
* a textured box bouncing around the lower part of the frame,
* at the top, the code of the display index ``i`` (see ``frame_code``).

numpy only (no PyAV).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

if __package__:  # imported as ``datasets.video_frames`` (``python -m datasets.synthetic_video``)
    from .frame_code import code_cell_edges, draw_frame_index
else:  # ``datasets/`` on ``sys.path``
    from frame_code import code_cell_edges, draw_frame_index

__all__ = ["VFR_TICKS", "FrameSynth", "as_fraction", "frame_times"]

# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------


def as_fraction(x: float | Fraction | str) -> Fraction:
    """The frame rate ``x`` as an exact fraction."""
    if isinstance(x, Fraction):
        return x
    f = Fraction(str(x)) if not isinstance(x, int) else Fraction(x)
    # recognise the NTSC family (29.97 -> 30000/1001 etc.)
    for base in (24, 30, 48, 60, 120):
        ntsc = Fraction(base * 1000, 1001)
        if f != ntsc and abs(float(f) - float(ntsc)) < 5e-3:
            return ntsc
    return f


VFR_TICKS = 4  # ticks per nominal frame duration in VFR mode


def _vfr_multipliers(n_max: int, seed: int) -> list[int]:
    rng = np.random.default_rng([seed, 0xF4A])
    m = rng.integers(1, 3, size=n_max).tolist()  # 1x or 2x the nominal duration
    # guarantee both durations occur early on
    if n_max >= 2:
        m[0], m[1] = 1, 2
    return m


def frame_times(
    *, duration_s: float = 1.0, fps: float = 24.0, vfr: bool = False, seed: int = 0
) -> list[Fraction]:
    """Presentation times (seconds, exact) of the frames ``make_video`` writes.

    ``len(frame_times(...))`` is the number of frames; frame ``i`` in display
    order carries index ``i`` in its code strip.  CFR: ``round(duration*fps)``
    frames at ``i/fps``.  VFR: each frame lasts 1x or 2x the nominal ``1/fps``
    (seeded pattern) and frames are emitted while ``t < duration_s``.
    """
    rate = as_fraction(fps)
    if rate <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    dur = Fraction(str(duration_s))
    if not vfr:
        n = max(1, int(round(dur * rate)))
        return [Fraction(i) / rate for i in range(n)]
    nominal = 1 / rate
    mults = _vfr_multipliers(int(math.ceil(dur * rate)) + 2, seed)
    times, t = [], Fraction(0)
    for m in mults:
        if t >= dur and times:
            break
        times.append(t)
        t += m * nominal
    return times


# ---------------------------------------------------------------------------
# pixels (numpy, cheap per frame)
# ---------------------------------------------------------------------------

_Y_BLACK, _Y_WHITE = 16, 235  # limited-range luma of the code cells


def _even(v: float, lo: int = 2) -> int:
    return max(lo, 2 * int(round(v / 2.0)))


class FrameSynth:
    """Precomputes textures once; :meth:`render` fills a yuv420p buffer."""

    def __init__(self, width: int, height: int, seed: int):
        if width % 2 or height % 2:
            raise ValueError(f"video width/height must be even, got {width}x{height}")
        self.w, self.h = width, height
        rng = np.random.default_rng([seed, 0x5EED])
        w, h = width, height
        self.amp = amp = _even(max(8, min(w, h) // 8))
        cw, chh = w + 2 * amp, h + 2 * amp
        yy = np.linspace(0.0, 1.0, chh, dtype=np.float32)[:, None]
        xx = np.linspace(0.0, 1.0, cw, dtype=np.float32)[None, :]
        ph = rng.uniform(0, 2 * np.pi, size=4).astype(np.float32)
        grad = (
            110
            + 45 * np.sin(2 * np.pi * (1.3 * xx + 0.7 * yy) + ph[0])
            + 25 * np.cos(2 * np.pi * (0.4 * xx - 1.1 * yy) + ph[1])
        )
        # coarse blotches (blocky noise upsampled 8x) + fine per-pixel noise
        cb = 8
        coarse = rng.normal(0, 14, size=(chh // cb + 1, cw // cb + 1)).astype(np.float32)
        coarse = np.repeat(np.repeat(coarse, cb, 0), cb, 1)[:chh, :cw]
        fine = rng.normal(0, 6, size=(chh, cw)).astype(np.float32)
        self.layer1 = np.clip(grad + coarse + fine, 20, 200).astype(np.uint8)
        # second layer moving the other way: low-amplitude grain (adds 0..40;
        # sigma 3 gives ~3.5 Mbit/s for 720p30 x264 crf 23, like real footage)
        self.layer2 = np.clip(rng.normal(20, 3, size=(chh, cw)), 0, 40).astype(np.uint8)
        # chroma canvases at half resolution, kept inside [48, 208] so the
        # per-frame drift (|d| <= 24) never wraps around
        hc, wc = chh // 2, cw // 2
        yyc = np.linspace(0.0, 1.0, hc, dtype=np.float32)[:, None]
        xxc = np.linspace(0.0, 1.0, wc, dtype=np.float32)[None, :]
        noise_c = rng.normal(0, 6, size=(2, hc, wc)).astype(np.float32)
        u = 128 + 45 * np.sin(2 * np.pi * (0.9 * xxc + 0.2 * yyc) + ph[2]) + noise_c[0]
        v = 128 + 45 * np.cos(2 * np.pi * (0.3 * xxc + 0.8 * yyc) + ph[3]) + noise_c[1]
        self.canv_u = np.clip(u, 48, 208).astype(np.uint8)
        self.canv_v = np.clip(v, 48, 208).astype(np.uint8)
        # code strip geometry (luma only: the strip's chroma is neutral)
        self.code_edges = code_cell_edges(w, h)
        strip_end = self.code_edges[1][-1]
        self.strip_h = strip_end + strip_end % 2  # even
        # bouncing box below the strip
        self.box_h = min(_even(h * 0.25), _even(max(2, h - self.strip_h - 2)))
        self.box_w = _even(w * 0.2)
        bh, bw = self.box_h, self.box_w
        chk = ((np.arange(bh)[:, None] // 4 + np.arange(bw)[None, :] // 4) % 2) * 90
        self.box_y = np.clip(
            80 + chk + rng.normal(0, 10, size=(bh, bw)), 16, 235
        ).astype(np.uint8)
        self.box_uv = (int(rng.integers(60, 100)), int(rng.integers(160, 200)))
        self.speed = (_even(max(2, w / 48)), _even(max(2, h / 40)))
        self.n_pix = w * h

    @staticmethod
    def _tri(pos: int, span: int) -> int:
        if span <= 0:
            return 0
        p = pos % (2 * span)
        return p if p <= span else 2 * span - p

    def render(self, index: int, out: np.ndarray) -> np.ndarray:
        """Write frame ``index`` into ``out`` (flat uint8, yuv420p layout)."""
        w, h, amp = self.w, self.h, self.amp
        n = self.n_pix
        Y = out[:n].reshape(h, w)
        U = out[n : n + n // 4].reshape(h // 2, w // 2)
        V = out[n + n // 4 :].reshape(h // 2, w // 2)
        # pan layer 1 along a Lissajous path, layer 2 the opposite way
        t = float(index)
        ox = _even(amp + amp * math.sin(2 * math.pi * t / 97.0), 0)
        oy = _even(amp + amp * math.sin(2 * math.pi * t / 131.0 + 1.0), 0)
        ox2 = _even(amp - amp * math.sin(2 * math.pi * t / 61.0 + 0.5), 0)
        oy2 = _even(amp - amp * math.cos(2 * math.pi * t / 83.0), 0)
        np.add(self.layer1[oy : oy + h, ox : ox + w], self.layer2[oy2 : oy2 + h, ox2 : ox2 + w], out=Y)
        d = int(round(24 * math.sin(2 * math.pi * t / 150.0)))
        for plane, canv in ((U, self.canv_u), (V, self.canv_v)):
            src = canv[oy // 2 : oy // 2 + h // 2, ox // 2 : ox // 2 + w // 2]
            if d >= 0:
                np.add(src, np.uint8(d), out=plane)
            else:
                np.subtract(src, np.uint8(-d), out=plane)
        # bouncing box
        bh, bw = self.box_h, self.box_w
        if bh > 0 and bw > 0 and self.strip_h + bh <= h:
            bx = 2 * (self._tri(index * self.speed[0], w - bw) // 2)
            by = self.strip_h + 2 * (
                self._tri(index * self.speed[1], h - self.strip_h - bh) // 2
            )
            Y[by : by + bh, bx : bx + bw] = self.box_y
            U[by // 2 : (by + bh) // 2, bx // 2 : (bx + bw) // 2] = self.box_uv[0]
            V[by // 2 : (by + bh) // 2, bx // 2 : (bx + bw) // 2] = self.box_uv[1]
        # frame-index code strip
        draw_frame_index(Y, index, self.code_edges, black=_Y_BLACK, white=_Y_WHITE)
        U[: self.strip_h // 2] = 128
        V[: self.strip_h // 2] = 128
        return out
