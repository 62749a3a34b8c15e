"""Figures the engine benchmark derives: timers that wait for the device, FLOPs, MFU, the bandwidth floor.

FLOP counts are for one forward (multiply-add = 2 FLOPs), matmuls only:

* LLM prefill of ``T`` tokens from an empty cache: ``2 * P_layers * T`` for the decoder layers'
  linear weights plus causal attention ``2 * L * Hq * D * T^2`` (QK^T and PV, each half of ``T^2``).
* ViT over ``P`` patches: ``2 * P_blocks * P`` for the blocks' linear weights, the patch embedding
  and the merger (on ``P / merge^2`` rows), plus attention ``4 * H * D * P * K`` per layer, with
  ``K`` the keys a patch sees: its window in windowed layers, its whole frame in full layers.

The decode floor is the bytes one step must read (every decoder and output weight, the KV of the
batch) divided by the device's copy bandwidth measured in the same run.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from typing import Any

import torch

#: Dense tensor-core peak (TFLOP/s) by device name and dtype, from NVIDIA's data sheets (no sparsity).
PEAK_TFLOPS = {
    "H100 PCIe": {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0},
    "H100": {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9},  # SXM / HBM3
    "H200": {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones, device work included."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, num_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s a device-to-device copy moves (each byte read once and written once: 2x the size).

    The best of ``repeats`` timings, not their median: the floor it gives is a bound, and a slow sample (a
    clock dip, another tenant of the machine) would raise the floor and flatter every ratio to it. Two H100
    runs of the same build measured medians of 2955 and 2819 GB/s (docs/gpu.md). On CUDA each timing is four
    back-to-back copies between two events, so no host synchronisation is inside it.
    """
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):  # warm-up
        dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(4):
                dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000.0 / 4
        else:
            began = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - began
        best = min(best, seconds)
    del src, dst
    return 2 * num_bytes / best


def peak_tflops(device: torch.device, dtype: str, override: float | None) -> tuple[float | None, str]:
    """The peak to divide by, and where it came from (``None`` when unknown: MFU is then left out)."""
    if override:
        return override, "--peak-tflops"
    if device.type != "cuda":
        return None, "no peak known for a CPU (give --peak-tflops)"
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS.items():  # "H100 PCIe" before "H100"
        if key in name:
            return table[dtype], f"data sheet ({key}, {dtype}, dense)"
    return None, f"no peak known for {name!r} (give --peak-tflops)"


def linear_params(module: torch.nn.Module) -> int:
    """Weights of the module's ``nn.Linear`` layers (biases excluded)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def prefill_flops(text_config, layers: torch.nn.Module, tokens: int) -> float:
    """FLOPs of one causal prefill of ``tokens`` tokens (see the module docstring)."""
    attention = 2 * text_config.num_hidden_layers * text_config.num_attention_heads * text_config.head_dim * tokens ** 2
    return 2.0 * linear_params(layers) * tokens + attention


def vit_flops(vision_config, visual: torch.nn.Module, grids: list[tuple[int, int, int]]) -> float:
    """FLOPs of one vision-tower forward over frames ``(t, h, w)`` in patches (see the module docstring)."""
    v = vision_config
    patches = sum(t * h * w for t, h, w in grids)
    merge = v.spatial_merge_size ** 2
    merger = linear_params(visual.merger)
    # the blocks' weights at the checkpoint's widths: the zero padding a CUDA model's MLPs carry
    # (VisionTower.align_mlp) is not work the model asks for
    blocks = v.depth * (4 * v.hidden_size ** 2 + 3 * v.hidden_size * v.intermediate_size)  # qkv + proj, gate/up/down
    flops = 2.0 * (blocks * patches + v.patch_dim * v.hidden_size * patches + merger * patches / merge)
    window = (v.window_size // v.patch_size) ** 2  # patches per attention window
    full = len(v.fullatt_block_indexes)
    per_key = 4 * v.num_heads * (v.hidden_size // v.num_heads)
    for t, h, w in grids:
        frame = h * w
        keys_windowed = min(window, frame)
        flops += per_key * t * frame * ((v.depth - full) * keys_windowed + full * frame)
    return flops


def decode_bytes(model, batch: int, context: int) -> int:
    """Bytes one decode step reads: every weight of the decoder and the output projection (the
    embedding table only for the batch's rows), and the KV of ``batch`` sequences of ``context`` tokens."""
    lm = model.language_model
    t = model.config.text
    itemsize = next(lm.parameters()).element_size()
    weights = sum(p.numel() for p in lm.parameters()) * itemsize
    if lm.lm_head is not None:  # untied: the embedding table is gathered, not read whole
        weights -= lm.tok_embeddings.weight.numel() * itemsize - batch * t.hidden_size * itemsize
    kv = batch * context * t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * itemsize
    return weights + kv


#: kernel name (lower case) -> kind, first match wins; cuBLAS's Hopper GEMMs are ``nvjet_*`` and ``sm90_xmma_*``, the
#: project's decode GEMM (Triton) ``skinny_kernel`` (a norm folded into it counts as GEMM time)
KERNEL_KINDS = (
    ("attention", re.compile(r"flashinfer|batchdecode|batchprefill|prefill_kernel|decode_kernel|merge_state|"
                             r"flash_fwd|fmha|attention")),
    ("gemm", re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|splitk|sm90_|sm80_|ampere_|dot_kernel|skinny")),
    ("norm/rotary/act", re.compile(r"rms_norm|rmsnorm|rotary|silu|gelu|layer_norm|softmax|norm")),
    ("copy/index", re.compile(r"copy|memcpy|memset|fill|cat|index|gather|scatter|pad|slice")),
    ("elementwise", re.compile(r"elementwise|vectorized|reduce|unrolled")),
)


def kernel_kind(name: str) -> str:
    """The :data:`KERNEL_KINDS` entry a kernel's name falls under, else ``other``."""
    low = name.lower()
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(low)), "other")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: device time busy, overlapping work counted once."""
    busy, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start >= reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy


def summarize_kernels(kernels: list[tuple[str, float, float]], calls: int, top: int = 12) -> dict:
    """Per-call device time by kind of kernel, from ``(name, start_us, end_us)`` records of ``calls`` calls.

    ``busy_us`` is the union of the kernels' intervals (overlapping kernels count once) and ``span_us`` the
    first start to the last end, both per call; their difference is time the device ran nothing (launch gaps,
    waits). ``kinds`` maps each kind to ``{"us", "count"}`` per call; ``top`` lists the costliest kernels.
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    kinds: dict[str, dict] = {}
    names: dict[str, list] = {}
    for name, start, end in kernels:
        entry = kinds.setdefault(kernel_kind(name), {"us": 0.0, "count": 0})
        entry["us"] += end - start
        entry["count"] += 1
        acc = names.setdefault(name, [0.0, 0])
        acc[0] += end - start
        acc[1] += 1
    busy = union_length([(start, end) for _, start, end in kernels])
    span = (max(k[2] for k in kernels) - min(k[1] for k in kernels)) if kernels else 0.0
    ranked = sorted(names.items(), key=lambda item: -item[1][0])[:top]
    return {
        "calls": calls,
        "kernels_per_call": len(kernels) / calls,
        "busy_us": busy / calls,
        "span_us": span / calls,
        "kinds": {kind: {"us": v["us"] / calls, "count": v["count"] / calls}
                  for kind, v in sorted(kinds.items(), key=lambda item: -item[1]["us"])},
        "top": [{"name": name[:120], "kind": kernel_kind(name), "us": us / calls, "count": n / calls}
                for name, (us, n) in ranked],
    }


def check_cuda(device: torch.device, what: str) -> None:
    """Raises ``ValueError`` unless ``device`` is a CUDA device (the profiles need CUPTI)."""
    if device.type != "cuda":
        raise ValueError(f"{what} needs a CUDA device")


def cuda_profile(run, device: torch.device, read) -> tuple[Any, str]:
    """``run()`` under torch's profiler (CUDA activity alone: the runtime calls come with it; CPU op records would slow
    the host), the device synchronized inside it, then ``read(prof)``: ``(what read returned, '')``, or
    ``(None, why)`` when the profiler fails (a machine may refuse CUPTI to non-admin users), so that a benchmark run
    keeps its other results."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            sync(device)
        return read(prof), ""
    except Exception as e:  # noqa: BLE001 - CUPTI's refusals come as several types
        return None, f"the profiler failed: {type(e).__name__}: {e}"[:300]


def kernel_profile(fn, device: torch.device, calls: int = 5) -> dict:
    """What the device runs for ``fn()`` (a graph replay, a forward): ``calls`` calls under torch's profiler
    (CUPTI), summarised by :func:`summarize_kernels`. CUDA only; kernels inside a CUDA graph are recorded one
    by one. Returns ``{"error": ...}`` instead of raising when the profiler fails or records no kernel (a
    machine may refuse CUPTI to non-admin users): a benchmark run keeps its other results."""
    from torch.autograd import DeviceType

    check_cuda(device, "kernel_profile")
    fn()  # warm: nothing first-time inside the window
    sync(device)
    events, error = cuda_profile(lambda: [fn() for _ in range(calls)], device, lambda prof: prof.events())
    if error:
        return {"error": error}
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events
               if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    if not kernels:
        return {"error": "the profiler recorded no kernel"}
    return summarize_kernels(kernels, calls)


def format_kernels(summary: dict) -> str:
    """One line: time per call by kind (kernels per call), busy vs span."""
    if "error" in summary:
        return summary["error"]
    kinds = ", ".join(f"{kind} {v['us']:.1f} ({v['count']:g})" for kind, v in summary["kinds"].items())
    return (f"{kinds}; busy {summary['busy_us']:.1f} of {summary['span_us']:.1f} us "
            f"({summary['kernels_per_call']:g} kernels)")


def machine_info(device: torch.device) -> dict:
    """Machine, versions and commit for the JSON (no optional imports: the GPU image lacks PyAV)."""
    from flashcodec._provenance import source_commit

    commit = source_commit()
    info = {"machine": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "commit": commit, "device": str(device),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    try:
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
    except ImportError:
        info["flashinfer"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    sms=props.multi_processor_count)
    return info


@torch.inference_mode()
def _unpadded_mlp(mlp: torch.nn.Module, width: int) -> torch.nn.Module:
    """A copy of a padded MLP (``MLP.pad_intermediate``) cut back to ``width`` units: the same function."""
    import copy

    out = copy.deepcopy(mlp)
    pad = mlp.intermediate_size
    with torch.no_grad():
        rows = torch.cat([torch.arange(width), pad + torch.arange(width)]).to(mlp.gate_up_proj.weight.device)
        out.gate_up_proj.weight = torch.nn.Parameter(mlp.gate_up_proj.weight[rows].contiguous(), requires_grad=False)
        if mlp.gate_up_proj.bias is not None:
            out.gate_up_proj.bias = torch.nn.Parameter(mlp.gate_up_proj.bias[rows].contiguous(), requires_grad=False)
        out.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight[:, :width].contiguous(), requires_grad=False)
    out.gate_up_proj.out_features, out.down_proj.in_features, out.intermediate_size = 2 * width, width, width
    return out


def vision_split(tower: torch.nn.Module, patches: torch.Tensor, grids: list[tuple[int, int, int]],
                 device: torch.device, repeats: int) -> dict:
    """Where the vision tower's time goes (milliseconds of one forward over ``patches``).

    ``tower_ms``: the whole tower with each attention kernel of :mod:`unifiedserve.attention.varlen` (a kernel this
    device or dtype lacks gives its error instead). Then its parts, each timed alone over the same rows and summed
    over the layers: the MLPs, the attention's linear layers (qkv and proj), and the attention kernel the tower uses
    by default on the windowed and the full-attention layers' segments; ``other_ms`` is the default tower's time
    less those (norms, rotary, the window reorder, patch embedding and merger, launches). When the MLPs were padded
    to an aligned width on load (``mlp_width``), ``mlp_checkpoint_width_ms`` times them at the checkpoint's width.
    """
    from unifiedserve.attention.varlen import VARLEN_IMPLS, resolve_varlen_impl
    from unifiedserve.model.vision import varlen_attention, vision_layout

    cfg = tower.config
    dtype = tower.patch_embed.weight.dtype
    before = tower.blocks[0].attn.attention_impl
    default = resolve_varlen_impl(before, device, dtype)
    out: dict = {"attention_impl": default, "tower_ms": {}}
    try:
        for impl in (i for i in VARLEN_IMPLS if i != "auto"):
            tower.set_attention_impl(impl)
            try:
                out["tower_ms"][impl] = 1e3 * median_seconds(lambda: tower(patches, grids), device, repeats)
            except Exception as e:  # e.g. flashinfer on the CPU
                out["tower_ms"][impl] = f"{type(e).__name__}: {e}"[:200]
    finally:
        tower.set_attention_impl(before)
    n, depth, full = patches.shape[0], len(tower.blocks), len(cfg.fullatt_block_indexes)
    block = tower.blocks[0]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, cfg.hidden_size, generator=gen, device=device, dtype=dtype)
    out["mlp_ms"] = 1e3 * depth * median_seconds(lambda: block.mlp(x), device, repeats)
    out["mlp_width"] = block.mlp.intermediate_size
    if block.mlp.intermediate_size != cfg.intermediate_size:  # padded on load (align_mlp): time the checkpoint's
        unpadded = _unpadded_mlp(block.mlp, cfg.intermediate_size)  # width too, what the padding buys
        out["mlp_checkpoint_width_ms"] = 1e3 * depth * median_seconds(lambda: unpadded(x), device, repeats)
        del unpadded
    out["attn_linears_ms"] = 1e3 * depth * median_seconds(
        lambda: block.attn.proj(block.attn.qkv(x)[:, :cfg.hidden_size]), device, repeats)
    layout = vision_layout(tuple(tuple(int(v) for v in g) for g in grids), cfg.spatial_merge_size,
                           cfg.window_merge_units)
    q, k, v = (torch.randn(n, cfg.num_heads, cfg.head_dim, generator=gen, device=device, dtype=dtype)
               for _ in range(3))
    scale = cfg.head_dim ** -0.5

    def kernel(lens):
        return median_seconds(lambda: varlen_attention(q, k, v, lens, scale, default), device, repeats)

    out["attention_window_ms"] = 1e3 * (depth - full) * kernel(layout.window_lens)
    out["attention_full_ms"] = 1e3 * full * kernel(layout.frame_lens)
    whole = out["tower_ms"].get(default)
    if isinstance(whole, float):
        out["other_ms"] = whole - sum(out[k] for k in ("mlp_ms", "attn_linears_ms", "attention_window_ms",
                                                       "attention_full_ms"))
    return out
