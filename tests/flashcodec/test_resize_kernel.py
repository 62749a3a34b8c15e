"""The fused GPU resize (flashcodec/resize_kernel.py): its weights, its kernel under Triton's interpreter
on the CPU, and on CUDA against the torch reference (flashcodec.resize.resize_frames)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from flashcodec.resize import resize_frames, resize_frames_on_device
from flashcodec.resize_kernel import aa_bicubic_weights, fused_resize_available

ROOT = Path(__file__).resolve().parents[2]
HAVE_TRITON = importlib.util.find_spec("triton") is not None

# (H, W) -> (h, w): shrink both (the video case: 1080p to a few hundred pixels), grow, mixed, odd sizes
SIZES = [((64, 96), (28, 56)), ((30, 40), (56, 84)), ((72, 128), (72, 56)), ((37, 101), (20, 33)),
         ((1080, 1920), (392, 728))]


def frames(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """Smooth gradients plus noise: values spread over 0..255, with many pixels near rounding edges."""
    g = torch.Generator().manual_seed(seed)
    y = torch.linspace(0, 255, h).view(1, 1, h, 1)
    x = torch.linspace(0, 255, w).view(1, 1, 1, w)
    base = (y * 0.6 + x * 0.4).expand(n, 3, h, w)
    return (base + torch.randn((n, 3, h, w), generator=g) * 40).clamp(0, 255).to(torch.uint8)


def resize_with_weights(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The same resize through dense float64 matrices built from :func:`aa_bicubic_weights`: a
    readable check of the weights (not fast), uint8 ``[N, 3, H, W]`` -> uint8 ``[N, 3, height, width]``."""
    n, c, h, w = frames.shape

    def dense(in_size: int, out_size: int) -> torch.Tensor:
        starts, weights = aa_bicubic_weights(in_size, out_size)
        m = torch.zeros(out_size, in_size, dtype=torch.float64)
        for i in range(out_size):
            taps = min(weights.shape[1], in_size - int(starts[i]))
            m[i, starts[i]:starts[i] + taps] = torch.from_numpy(weights[i, :taps].astype(np.float64))
        return m

    wy, wx = dense(h, height), dense(w, width)  # [height, H], [width, W]
    out = torch.einsum("yh,nchw,xw->ncyx", wy, frames.double().cpu(), wx)
    return out.round().clamp(0, 255).to(torch.uint8).to(frames.device)


def agreement(got: torch.Tensor, want: torch.Tensor) -> tuple[int, float]:
    diff = (got.int() - want.int()).abs()
    return int(diff.max()), float((diff == 0).float().mean())


@pytest.mark.parametrize("src,dst", SIZES)
def test_weights_are_normalised_and_cover_the_support(src, dst):
    for in_size, out_size in zip(src, dst):
        starts, weights = aa_bicubic_weights(in_size, out_size)
        assert starts.shape == (out_size,) and weights.shape[0] == out_size
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-5)
        assert starts.min() >= 0 and starts.max() < in_size
        assert np.all(np.diff(starts) >= 0)  # windows move right with the output pixel
        # no weight falls past the input's last pixel
        taps = weights.shape[1]
        for i in range(out_size):
            assert not np.any(weights[i, max(0, in_size - int(starts[i])):taps])


@pytest.mark.parametrize("src,dst", SIZES[:4])
def test_weights_reproduce_the_reference_resize(src, dst):
    """The dense resize from these weights is the reference resize up to a level on rounding edges."""
    x = frames(2, *src)
    worst, exact = agreement(resize_with_weights(x, *dst), resize_frames(x, *dst))
    assert worst <= 1 and exact >= 0.999


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="positive"):
        aa_bicubic_weights(0, 4)


def test_not_used_on_the_cpu_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused_resize_available("cpu")
    x = frames(1, 20, 24)
    assert torch.equal(resize_frames_on_device(x, 8, 12), resize_frames(x, 8, 12))  # the reference ran


def test_switch_off(monkeypatch):
    monkeypatch.setenv("FLASHCODEC_NO_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fused_resize_available("cpu")


INTERPRETED = textwrap.dedent("""
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is built
    sys.path.insert(0, {root!r})
    from flashcodec.resize import resize_frames
    from flashcodec.resize_kernel import fused_resize_available, resize_frames_fused
    from tests.flashcodec.test_resize_kernel import agreement, frames
    assert fused_resize_available("cpu")
    # shrink: 20x24 -> 8x12 (10 and 9 taps); grow: 6x5 -> 12x14; a channels-last source; into a strided out
    x = frames(2, 20, 24, seed=1)
    print("shrink", *agreement(resize_frames_fused(x, 8, 12), resize_frames(x, 8, 12)))
    y = frames(1, 6, 5, seed=2)
    print("grow", *agreement(resize_frames_fused(y, 12, 14), resize_frames(y, 12, 14)))
    z = x.contiguous(memory_format=torch.channels_last)
    out = torch.zeros(2, 12, 8, 3, dtype=torch.uint8).permute(0, 3, 1, 2)  # [2, 3, 12, 8], HWC in memory
    got = resize_frames_fused(z, 12, 8, out=out)
    print("strided", *agreement(got, resize_frames(x, 12, 8)), int(got.data_ptr() == out.data_ptr()))
    print("same-size", int(resize_frames_fused(x, 20, 24) is x))
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_kernel_under_the_triton_interpreter_matches_the_reference():
    """The Triton kernel itself, run by Triton's interpreter on the CPU (slow: tiny frames)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", INTERPRETED.format(root=str(ROOT))], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict((line.split()[0], line.split()[1:]) for line in run.stdout.splitlines())
    for case in ("shrink", "grow", "strided"):
        worst, exact = int(lines[case][0]), float(lines[case][1])
        assert worst <= 1 and exact >= 0.99, (case, lines[case])
    assert lines["strided"][2] == "1"  # written into the given out
    assert lines["same-size"] == ["1"]


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("src,dst", SIZES)
def test_cuda_kernel_matches_the_reference(src, dst):
    x = frames(3, *src).cuda()
    assert fused_resize_available(x.device)
    from flashcodec.resize_kernel import resize_frames_fused

    worst, exact = agreement(resize_frames_fused(x, *dst), resize_frames(x, *dst))
    assert worst <= 1 and exact >= 0.999
    # the CPU reference of the same frames (issue 12: GPU vs CPU output within 1 level)
    worst, exact = agreement(resize_frames_on_device(x, *dst).cpu(), resize_frames(x.cpu(), *dst))
    assert worst <= 1 and exact >= 0.999


PATCHIFY = textwrap.dedent("""
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from flashcodec.patches import PatchSpec, frames_to_patches
    from flashcodec.patch_kernel import fused_patchify_available, patches_fused
    assert fused_patchify_available("cpu")
    g = torch.Generator().manual_seed(3)
    # 3 frames (the last temporal patch repeats frame 2), channels-last, into a float32 and a bf16 out
    frames = torch.randint(0, 256, (3, 3, 56, 84), generator=g, dtype=torch.uint8)
    frames = frames.contiguous(memory_format=torch.channels_last)
    for dtype in (torch.float32, torch.bfloat16):
        want, grid = frames_to_patches(frames, dtype=dtype)  # the torch path (CPU tensors)
        got = torch.full_like(want, float("nan"))
        patches_fused(frames, PatchSpec(), got)
        diff = (got.float() - want.float()).abs().max().item()
        print(str(dtype).split(".")[1], diff, int(torch.isnan(got).any()), *grid)
    # a row stride wider than a row (a slice of a wider buffer) and another spec
    spec = PatchSpec(patch_size=7, temporal_patch_size=1, merge_size=2, image_mean=(0.5, 0.5, 0.5),
                     image_std=(0.25, 0.5, 1.0))
    want, _ = frames_to_patches(frames[:1, :, :28, :28], spec)
    wide = torch.zeros(want.shape[0], want.shape[1] + 5)
    patches_fused(frames[:1, :, :28, :28], spec, wide[:, :want.shape[1]])
    print("strided", (wide[:, :want.shape[1]] - want).abs().max().item(), int(wide[:, want.shape[1]:].any()))
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_patchify_kernel_under_the_triton_interpreter_matches_the_torch_path():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", PATCHIFY.format(root=str(ROOT))], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines()}
    assert float(lines["float32"][0]) <= 1e-6 and lines["float32"][1] == "0"  # every value written
    assert lines["float32"][2:] == ["2", "4", "6"]
    assert float(lines["bfloat16"][0]) <= 0.016 and lines["bfloat16"][1] == "0"  # within one bf16 step
    assert float(lines["strided"][0]) <= 1e-6 and lines["strided"][1] == "0"  # nothing past the row


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_patchify_matches_the_cpu_path(dtype):
    from flashcodec.patch_kernel import fused_patchify_available
    from flashcodec.patches import frames_to_patches

    assert fused_patchify_available("cuda")
    x = frames(5, 392, 728, seed=4)
    want, grid = frames_to_patches(x, dtype=dtype)  # CPU: the torch path
    got, got_grid = frames_to_patches(x.cuda(), dtype=dtype)  # CUDA: the kernel
    assert got_grid == grid
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-5 if dtype == torch.float32 else 0.016,
                               rtol=0)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_gpu_kernels_compile_for_hopper_once_for_every_size():
    """flashcodec's two Triton kernels compile for sm_90 here (no GPU needed: Triton's own ptxas), with the video's
    sizes, tap counts and outer strides as runtime values: one compilation serves every video, so the start-up
    warm-up (vision_devices.warm_gpu_kernels) leaves no compile for a request's path. Innermost strides stay
    specialised (1: dense rows)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashcodec import patch_kernel, resize_kernel

    cases = [
        (resize_kernel, {"src": "*u8", "dst": "*u8", "x_start": "*i32", "x_weight": "*fp32", "y_start": "*i32",
                         "y_weight": "*fp32"}, {"s_w": 1, "d_w": 1, "BLOCK": 128}),
        (patch_kernel, {"src": "*u8", "dst": "*bf16", "scale": "*fp32", "bias": "*fp32"},
         {"s_w": 1, "P": 14, "TP": 2, "M": 2, "COLS": 1176, "BLOCK": 2048}),
    ]
    for module, pointers, constants in cases:
        kernel = module._kernel(False)[1]
        runtime = {p.name for p in kernel.params if p.do_not_specialize}
        assert runtime == set(module.RUNTIME_ARGS)
        assert {p.name for p in kernel.params} == set(pointers) | runtime | set(constants)
        signature = {**pointers, **{name: "i32" for name in module.RUNTIME_ARGS},
                     **{name: "constexpr" for name in constants}}
        compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], module.__name__


@pytest.mark.cuda
def test_cuda_one_compilation_serves_every_size():
    """Videos of other sizes (other tap counts, other divisibility) reuse the kernel the first one compiled."""
    from flashcodec import resize_kernel

    kernel = resize_kernel._kernel(False)[1]
    resize_frames_on_device(frames(2, 64, 96).cuda(), 28, 56)  # compiled here, or by an earlier test
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton version keeps its compiled kernels elsewhere")
    before = sum(len(cache[0]) for cache in caches.values())
    for (h, w), (oh, ow) in SIZES:
        resize_frames_on_device(frames(2, h, w, seed=1).cuda(), oh, ow)
    assert sum(len(cache[0]) for cache in caches.values()) == before
