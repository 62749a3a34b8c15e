"""Where the vision process decodes and writes: FlashCodec's devices for it (NVDEC on the server's GPU, CPU
decoders, or both), nvJPEG for its images, the start-up line that names them, the GPU resize and patchify warmed
before the first request, and which paged write the patch buffer gets.
"""

from __future__ import annotations

import logging

import torch

from flashcodec import DecodeEngine
from flashcodec.devices import log_once
from flashcodec.image_batch import nvjpeg_unavailable_reason
from unifiedserve import ops

__all__ = ["decode_devices", "describe_decoders", "image_decode_gpu", "warm_gpu_kernels", "write_op"]


def decode_devices(vision_device: str, pool_device: torch.device) -> str:
    """FlashCodec's ``devices`` for the vision process (``RuntimeConfig.vision_device``).

    With the patch buffer on a GPU, ``"auto"`` decodes on that GPU's NVDEC sessions and the CPU decoders
    together (FlashCodec's ``auto``: NVDEC only where it works here, one log line otherwise), ``"cuda"`` on
    NVDEC with the CPU decoders only for what NVDEC cannot take, ``"cpu"`` on the CPU decoders. The
    process sees one GPU, the server's. With the buffer on the CPU, the CPU decodes.
    """
    if pool_device.type != "cuda":
        if vision_device == "cuda":
            raise ValueError("vision_device cuda (NVDEC) needs the patch buffer on a GPU")
        return "cpu"
    return vision_device


def image_decode_gpu(vision_device: str, pool_device: torch.device,
                     unavailable_reason=nvjpeg_unavailable_reason) -> torch.device | None:
    """The GPU whose nvJPEG decodes the vision process's images, or None where they decode on the CPU.

    Decided as for videos (:func:`decode_devices`): ``"cpu"``, or the patch buffer on the CPU, decodes
    on the CPU; ``"auto"`` and ``"cuda"`` use the buffer's GPU when nvJPEG works there, else the CPU with
    one log line saying why (``"cuda"`` asks for NVDEC; it does not make images fail).

    Args:
        unavailable_reason: ``gpu_index -> why nvJPEG cannot run there, or None`` (tests replace it).
    """
    if decode_devices(vision_device, pool_device) == "cpu":
        return None
    gpu = torch.device("cuda", pool_device.index or 0)  # the process sees one GPU, the server's
    reason = unavailable_reason(gpu.index)
    if reason is None:
        return gpu
    # a fallback, not a refusal, for "cuda" too: that choice is about NVDEC, and images decode fine on the CPU
    log_once(f"vision_device {vision_device} decodes images on the CPU: nvJPEG is not usable on {gpu} ({reason})",
             logging.INFO if vision_device == "auto" else logging.WARNING)
    return None


def describe_decoders(engine: DecodeEngine) -> str:
    """The engine's ranks for the start-up line, e.g. ``nvdec cuda:0 x 14 sessions + pyav x 16 threads``."""
    layout = engine.layout
    ranks = [f"nvdec cuda:{gpu} x {layout.nvdec_sessions} sessions" for gpu in layout.gpus]
    if layout.cpu_threads:
        role = "" if layout.cpu_shares or not layout.gpus else " (only for what NVDEC cannot decode)"
        ranks.append(f"{engine.backend.name} x {layout.cpu_threads} threads{role}")
    return " + ".join(ranks) + f", output on {engine.output_device}"


def warm_gpu_kernels(spec, device: torch.device, dtype: torch.dtype) -> None:
    """Run the GPU resize and patchify at start-up in every layout a request's decode gives them, so that no first
    compile (Triton: about a second each, under a lock every NVDEC session waits on) nor the CUDA context is paid
    by the first request.

    Triton specialises each kernel on whether the frames' rows are dense (innermost stride 1), so each layout is
    its own compile. NVDEC frames come from torchcodec as a channels-last view (its NCHW is a permute of
    ``[N, H, W, 3]``) and FlashCodec's outputs are ``[T, H, W, 3]`` buffers permuted the same way: not dense. Until
    2026-11-27 the warm-up ran dense frames only, and the H100 server's first video compiled both kernels on its
    path (the first server on the machine: decode 1.87 s against 1.06 s for the next server's, from Triton's disk
    cache). Dense frames are warmed too (images, other callers)."""
    from flashcodec.patches import frames_to_patches
    from flashcodec.resize import resize_frames_on_device

    t, size = spec.temporal_patch_size, 2 * spec.factor
    dense = torch.zeros((t, 3, size, size), dtype=torch.uint8, device=device)
    channels_last = torch.zeros((t, size, size, 3), dtype=torch.uint8, device=device).permute(0, 3, 1, 2)
    for frames in (dense, channels_last):
        resize_frames_on_device(frames, spec.factor, spec.factor)  # its output has dense rows, as patchified below
        frames_to_patches(frames, spec, dtype=dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_op(device: torch.device) -> str:
    """Which paged write the patch buffer gets: csrc's native op, or the torch reference and why."""
    info = ops.build_info()
    if not info.get("native"):
        return f"torch reference ({info.get('reason') or 'native ops off'})"
    if device.type == "cuda" and not info.get("cuda"):
        return f"torch reference on CUDA ({info.get('cuda_reason') or 'no CUDA kernels built'})"
    return f"native ({'built' if info.get('built') else 'loaded'} in {info.get('seconds', 0.0):.2f} s)"
