"""The reference resize as one GPU kernel: uint8 frames in, uint8 frames out, no float32 copy of the frame.

:func:`flashcodec.resize.resize_frames` is Qwen2.5-VL's resize (torchvision's antialiased bicubic of
uint8 frames, computed in float32, rounded): on a GPU it converts every full-resolution frame to
float32 first (25 MB for a 1080p frame, 4x the decoded bytes), interpolates, then rounds, clamps and
casts in three more passes. :func:`resize_frames_fused` does the same arithmetic in one Triton kernel
that reads the uint8 frame once and writes the uint8 result once, which matters because the decoded
frames share the GPU's memory bandwidth with the language model's decode.

The arithmetic follows torch's CUDA kernel for ``F.interpolate(mode="bicubic", antialias=True,
align_corners=False)`` (``upsample_gen2d_aa_out_frame``): per axis, the output pixel ``i`` has the
centre ``scale * (i + 0.5)``, a support of ``2 * scale`` input pixels each side when shrinking (2 when
growing), and the normalised weights of the bicubic filter with ``a = -0.5`` (Pillow's, which torch uses
when antialiasing); each output is the weighted sum over rows of the weighted sums over columns, in
that order, in float32, then rounded half to even and clamped to 0..255. The weights are computed once
per (input size, output size) on the host in float32 (:func:`aa_bicubic_weights`) and kept on the
device. Results match :func:`~flashcodec.resize.resize_frames` to within one level on a pixel whose
float value falls next to a rounding boundary: the weights' last bits differ with the order of float
operations (torch's CPU kernel computes parts of them in double, its CUDA kernel contracts into fused
multiply-adds).

The kernel is Triton, which the GPU machine's torch ships with; on the CPU it runs in Triton's
interpreter (``TRITON_INTERPRET=1``) for the tests.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import numpy as np
import torch

from flashcodec._triton import CompileOnce, interpreting, kernel_builder, on_device, triton_usable

__all__ = ["aa_bicubic_weights", "fused_resize_available", "resize_frames_fused"]

#: the kernel's arguments Triton must not specialise on (see the kernel)
RUNTIME_ARGS = ("h_in", "w_in", "h_out", "w_out", "s_n", "s_c", "s_h", "d_n", "d_c", "d_h", "taps_x", "taps_y")
_F32 = np.float32
_BLOCK = 128  # output pixels of one row per program
_CACHE_ENTRIES = 16  # (device, in, out) weight tables kept on devices


@functools.lru_cache(maxsize=64)
def aa_bicubic_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Antialiased bicubic weights of one axis, as torch's CUDA kernel computes them (float32).

    Returns:
        ``(starts, weights)``: int32 ``[out_size]`` first input pixel of each output pixel, and float32
        ``[out_size, taps]`` its normalised weights over input pixels ``start .. start + taps - 1``
        (zero past its own support; ``taps`` is the widest support).
    """
    if in_size < 1 or out_size < 1:
        raise ValueError(f"sizes must be positive, got {in_size} -> {out_size}")
    half = _F32(0.5)
    scale = _F32(in_size) / _F32(out_size)
    support = _F32(4) * half * scale if scale >= 1 else _F32(4) * half
    invscale = _F32(1.0 / float(scale)) if scale >= 1 else _F32(1)
    a = _F32(-0.5)
    starts = np.zeros(out_size, dtype=np.int32)
    rows = []
    for i in range(out_size):
        center = scale * (_F32(i) + half)
        xmin = max(int(center - support + half), 0)
        xsize = min(int(center + support + half), in_size) - xmin
        x = (np.arange(xsize, dtype=_F32) + (_F32(xmin) - center) + half) * invscale
        x = np.abs(x)
        near = ((a + _F32(2)) * x - (a + _F32(3))) * x * x + _F32(1)
        far = ((a * x - _F32(5) * a) * x + _F32(8) * a) * x - _F32(4) * a
        w = np.where(x < 1, near, np.where(x < 2, far, _F32(0))).astype(_F32)
        total = _F32(0)
        for v in w:  # sequential, as the kernel sums
            total = _F32(total + v)
        if total != 0:
            w = (w / total).astype(_F32)
        starts[i] = xmin
        rows.append(w)
    taps = max(len(w) for w in rows)
    weights = np.zeros((out_size, taps), dtype=_F32)
    for i, w in enumerate(rows):
        weights[i, :len(w)] = w
    return starts, weights


def _build(triton, tl):
    """The Triton kernel (:data:`_kernel` builds it on first use)."""

    # Sizes, tap counts and the frame/row strides are plain runtime values (not specialised): Triton would
    # otherwise compile a variant per tap count and per pattern of sizes divisible by 16, so the first video of
    # each new size paid a compile (about a second) on its request's path, after the start-up warm-up had
    # compiled another. The innermost strides stay specialised: 1 (dense rows) lets loads and stores vectorise.
    @triton.jit(do_not_specialize=RUNTIME_ARGS)
    def resize_aa_kernel(src, dst, x_start, x_weight, y_start, y_weight, h_in, w_in, h_out, w_out,
                         s_n, s_c, s_h, s_w, d_n, d_c, d_h, d_w, taps_x, taps_y, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # one output row of one channel of one frame
        oy = row % h_out
        plane = row // h_out
        channel = plane % 3
        frame = (plane // 3).to(tl.int64)
        ox = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = ox < w_out
        x0 = tl.load(x_start + ox, mask=inside, other=0)
        y0 = tl.load(y_start + oy)
        src_plane = src + frame * s_n + channel * s_c
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        # while, not range: the same loop compiled, and Triton's interpreter (the CPU tests) cannot take a runtime
        # argument as a range bound under numpy 2
        j = 0
        while j < taps_y:  # rows of the support; each row's columns summed first, as torch does
            wy = tl.load(y_weight + oy * taps_y + j)
            y = tl.minimum(y0 + j, h_in - 1)  # past the support the weight is 0
            line = tl.zeros([BLOCK], dtype=tl.float32)
            i = 0
            while i < taps_x:
                wx = tl.load(x_weight + ox * taps_x + i, mask=inside, other=0.0)
                x = tl.minimum(x0 + i, w_in - 1)
                pixel = tl.load(src_plane + y * s_h + x * s_w, mask=inside, other=0).to(tl.float32)
                line += wx * pixel
                i += 1
            acc += wy * line
            j += 1
        # round half to even (torch's round), then clamp to the uint8 range
        low = tl.floor(acc)
        frac = acc - low
        odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
        rounded = tl.where(frac > 0.5, low + 1.0, tl.where(frac < 0.5, low, tl.where(odd, low + 1.0, low)))
        rounded = tl.minimum(tl.maximum(rounded, 0.0), 255.0)
        tl.store(dst + frame * d_n + channel * d_c + oy * d_h + ox * d_w, rounded.to(tl.uint8), mask=inside)

    return resize_aa_kernel


_kernel = kernel_builder(_build)  # (triton, the kernel) or None; the argument: interpreted


def fused_resize_available(device: torch.device | str) -> bool:
    """Whether :func:`resize_frames_fused` runs on ``device``: Triton importable, and a CUDA device (or
    any device under Triton's interpreter). ``FLASHCODEC_NO_TRITON=1`` turns it off."""
    return triton_usable(device) and _kernel(interpreting()) is not None


_tables: OrderedDict = OrderedDict()
_tables_lock = threading.Lock()
_launches = CompileOnce()  # variants: (frames' rows dense, their stride divisible by 16, output's rows dense)


def _device_tables(device: torch.device, in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (str(device), in_size, out_size)
    with _tables_lock:
        found = _tables.get(key)
        if found is not None:
            _tables.move_to_end(key)
            return found
    starts, weights = aa_bicubic_weights(in_size, out_size)
    found = (torch.from_numpy(starts).to(device), torch.from_numpy(weights).to(device))
    with _tables_lock:
        _tables[key] = found
        while len(_tables) > _CACHE_ENTRIES:
            _tables.popitem(last=False)
    return found


def resize_frames_fused(frames: torch.Tensor, height: int, width: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`flashcodec.resize.resize_frames` as one kernel (see the module docstring).

    Args:
        frames: uint8 ``[N, 3, H, W]``, any strides, on a CUDA device (any device under
            ``TRITON_INTERPRET=1``).
        height, width: output size (> 0).
        out: optional uint8 ``[N, 3, height, width]`` on the same device to write into (any strides).

    Returns:
        uint8 ``[N, 3, height, width]`` (``out`` when given); ``frames`` itself when the size matches
        and no ``out`` is given.

    Raises:
        ValueError: bad frames, size or ``out``; RuntimeError: Triton is not available here.
    """
    from flashcodec.resize import _check_frames

    _check_frames(frames, height, width)
    n, _, h, w = frames.shape
    if out is None and (h, w) == (height, width):
        return frames
    if out is None:
        out = torch.empty((n, 3, height, width), dtype=torch.uint8, device=frames.device)
    elif out.dtype != torch.uint8 or tuple(out.shape) != (n, 3, height, width) or out.device != frames.device:
        raise ValueError(f"out must be uint8 [{n}, 3, {height}, {width}] on {frames.device}, got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    built = _kernel(interpreting())
    if built is None:
        raise RuntimeError("resize_frames_fused needs Triton (pip install triton)")
    if n == 0:
        return out
    triton, kernel = built
    x_start, x_weight = _device_tables(frames.device, w, width)
    y_start, y_weight = _device_tables(frames.device, h, height)
    grid = (n * 3 * height, triton.cdiv(width, _BLOCK))
    # one compilation serves every size (see the kernel) for each pattern of innermost strides; the first launch
    # of a pattern compiles under a lock, so the NVDEC sessions' threads, which all start on the same video at
    # once, compile it once
    # (Triton also specialises an innermost stride divisible by 16: a rotated video's frames, W * 3)
    variant = (frames.stride(3) == 1, frames.stride(3) % 16 == 0, out.stride(3) == 1)
    taps = (x_weight.shape[1], y_weight.shape[1])

    def launch():
        # Triton launches on the current device: make it the frames' (an NVDEC rank of GPU 1 runs in a
        # thread whose current device may be 0)
        with on_device(frames.device):
            kernel[grid](frames, out, x_start, x_weight, y_start, y_weight, h, w, height, width, *frames.stride(),
                         *out.stride(), *taps, BLOCK=_BLOCK)

    _launches.launch(variant, launch)
    return out
