"""Host tensors to a device without making the host wait: the one way the engine sends host-built values up.

A plain ``tensor.to("cuda")`` or ``copy_`` from pageable host memory ends in a stream synchronize: the host
waits for every kernel already queued (a decode step, a graph replay), which undoes any overlap of host and
device work. :func:`to_device` stages through pinned memory and queues the copy instead (torch keeps the
pinned block until the copy has run).
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor -> ``device`` without blocking the host (pinned staging copy on CUDA); the CPU: ``t`` itself.

    A tensor already on ``device`` is returned as it is (e.g. patches of a video decoded with
    ``output_device="cuda"``, which reach the runner on the GPU), one on another GPU is copied device to device
    (queued), and one asked back to the CPU is copied there (the host waits for it).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return t if t.device.type == "cpu" else t.to(device)  # a device tensor read back: the host must wait
    if t.device.type != "cpu":
        return t if t.device == device else t.to(device, non_blocking=True)
    # contiguous first: pin_memory keeps the strides, and an expanded tensor (positions as arange(n).expand(3, -1),
    # stride 0) would be copied into itself
    return t.contiguous().pin_memory().to(device, non_blocking=True)


def write_to(dst: torch.Tensor, t: torch.Tensor) -> None:
    """Host ``t`` into the existing tensor ``dst`` (a CUDA graph's fixed input) as one queued copy.

    ``dst.copy_(to_device(t, ...))`` would be two device operations, the copy up into a fresh tensor and then a
    copy into ``dst`` (a kernel, when ``dst`` is a strided view); a step's operations outside its graph replay each
    cost the device a few microseconds, so a contiguous ``dst`` is written straight from page-locked memory. torch
    records the copy on the page-locked block, which it reuses only once the copy has run. On the CPU: a plain copy.

    Raises:
        ValueError: ``dst`` is not contiguous on a CUDA device (the copy would be staged), or ``t`` is not on the host.
    """
    if t.device.type != "cpu":
        raise ValueError(f"write_to copies host tensors, got one on {t.device}")
    if dst.device.type == "cpu":
        dst.copy_(t)
        return
    if not dst.is_contiguous():
        raise ValueError(f"write_to needs a contiguous destination (shape {list(dst.shape)}, "
                         f"stride {list(dst.stride())})")
    dst.copy_(t.to(dst.dtype).contiguous().pin_memory(), non_blocking=True)
