"""Normalise and patchify as one GPU kernel: uint8 frames in, model-ready patch rows out.

:func:`flashcodec.patches.frames_to_patches` cuts frames into Qwen2.5-VL's patch rows in two torch
passes (a reordering uint8 -> float copy, then ``bias + x * scale``). On a GPU
:func:`patches_fused` does it in one Triton kernel: each program writes one patch row (``3 x
temporal x patch x patch`` values) straight into the caller's output (a slice of the patch buffer,
say), reading each pixel once; the last temporal patch repeats the last frame, as Qwen does. The
value of every element is the reference's ``bias[c] + pixel * scale[c]`` in float32, stored in the
output's dtype (a fused multiply-add on the GPU, as torch's CUDA ``addcmul`` compiles to, so a
float32 result may differ from the CPU reference in its last bit).
"""

from __future__ import annotations


import torch

from flashcodec._triton import CompileOnce, interpreting, kernel_builder, on_device, triton_usable

__all__ = ["fused_patchify_available", "patches_fused"]

#: the kernel's arguments Triton must not specialise on (see the kernel)
RUNTIME_ARGS = ("num_frames", "groups_h", "groups_w", "s_t", "s_c", "s_h", "row_stride")
_launches = CompileOnce()  # variants: (frames' rows dense, output dtype)


def _build(triton, tl):
    """The Triton kernel (:data:`_kernel` builds it on first use)."""

    # the video's sizes and the frame/row strides are runtime values, not specialised: a variant per pattern of
    # sizes divisible by 16 made the first video of each new size compile (about a second) on its request's
    # path; the innermost stride stays specialised (1: dense rows)
    @triton.jit(do_not_specialize=RUNTIME_ARGS)
    def patchify_kernel(src, dst, scale, bias, num_frames, groups_h, groups_w, s_t, s_c, s_h, s_w, row_stride,
                        P: tl.constexpr, TP: tl.constexpr, M: tl.constexpr, COLS: tl.constexpr,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one patch row: frame pair, merge group, place in the group
        per_pair = groups_h * groups_w * M * M
        pair = row // per_pair
        within = row % per_pair
        group = within // (M * M)
        place = within % (M * M)
        py = (group // groups_w) * M + place // M  # patch coordinates on the frame's grid
        px = (group % groups_w) * M + place % M
        j = tl.arange(0, BLOCK)  # the row's values: [channel, temporal, patch row, patch column]
        inside = j < COLS
        channel = j // (TP * P * P)
        frame = tl.minimum(pair * TP + (j // (P * P)) % TP, num_frames - 1)  # past the end: the last frame
        y = py * P + (j // P) % P
        x = px * P + j % P
        pixel = tl.load(src + frame * s_t + channel * s_c + y * s_h + x * s_w, mask=inside, other=0)
        value = tl.load(bias + j, mask=inside, other=0.0) + pixel.to(tl.float32) * tl.load(scale + j, mask=inside,
                                                                                            other=0.0)
        tl.store(dst + row * row_stride + j, value.to(dst.dtype.element_ty), mask=inside)

    return patchify_kernel


_kernel = kernel_builder(_build)  # (triton, the kernel) or None; the argument: interpreted


def fused_patchify_available(device: torch.device | str) -> bool:
    """Whether :func:`patches_fused` runs on ``device`` (CUDA with Triton, or Triton's interpreter)."""
    return triton_usable(device) and _kernel(interpreting()) is not None


def patches_fused(frames: torch.Tensor, spec, out: torch.Tensor) -> None:
    """Write the patch rows of ``frames`` into ``out`` in one kernel.

    Args:
        frames: uint8 ``[T, 3, H, W]`` (any strides), H and W multiples of ``spec.factor``; checked by
            :func:`flashcodec.patches.frames_to_patches`, which calls this.
        spec: the :class:`~flashcodec.patches.PatchSpec`.
        out: floating ``[ceil(T / temporal) * (H / patch) * (W / patch), patch_dim]`` with a contiguous last
            dim, on the frames' device.
    """
    from flashcodec.patches import _scale_bias

    built = _kernel(interpreting())
    if built is None:
        raise RuntimeError("patches_fused needs Triton (pip install triton)")
    triton, kernel = built
    t, _, h, w = frames.shape
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    rows = out.shape[0]
    if rows == 0:
        return
    scale, bias = _scale_bias(spec, out.device)  # [patch_dim] float32 each

    def launch():
        with on_device(frames.device):  # Triton launches on the current device
            kernel[(rows,)](frames, out, scale, bias, t, h // p // m, w // p // m, *frames.stride(), out.stride(0),
                            P=p, TP=tp, M=m, COLS=spec.patch_dim, BLOCK=triton.next_power_of_2(spec.patch_dim))

    _launches.launch((frames.stride(3) == 1, out.dtype), launch)  # the first launch compiles, once
