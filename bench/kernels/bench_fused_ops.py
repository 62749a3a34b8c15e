#!/usr/bin/env python3
"""Fused layer ops benchmark: unifiedserve.ops (csrc/fused_ops*) vs the model's unfused torch code.

For each op (RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary of q and k) at the shapes of a model
(the demo, Qwen2.5-VL-3B or -7B) and a number of rows (decode batches and a prefill chunk), it checks the
fused result against the reference, then times both (best of repeats after a warm-up) and prints the
time per call, the ratio, and the GB/s of the bytes the op must move (read once + written once), whose
ceiling is the device's copy bandwidth, measured in the same run with a device-to-device copy.

On CUDA each timed call ends with ``torch.cuda.synchronize()`` (a call's latency, launch included); at
decode sizes that launch is what fusion removes.

    python bench/kernels/bench_fused_ops.py                        # CPU, demo + 7B widths
    python bench/kernels/bench_fused_ops.py --device cuda --quick  # the GPU check's setting
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from unifiedserve import ops  # noqa: E402
from unifiedserve.ops import reference  # noqa: E402

# name -> (hidden, intermediate, q heads, kv heads, head_dim): the text config of each preset
MODELS = {
    "demo": (256, 1344, 4, 2, 64),
    "qwen2.5-vl-3b": (2048, 11008, 16, 2, 128),
    "qwen2.5-vl-7b": (3584, 18944, 28, 4, 128),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--models", default=None, help="comma-separated from " + ", ".join(MODELS)
                   + " (default: demo,qwen2.5-vl-7b)")
    p.add_argument("--rows", default=None, help="comma-separated row counts (default 1,64,8192 CUDA; 1,8,1024 CPU)")
    p.add_argument("--quick", action="store_true", help="fewer repeats, 7B only")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="a folder or a .json file")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    try:
        args.rows = [int(r) for r in (args.rows or ("1,64,8192" if args.device == "cuda" else "1,8,1024")).split(",")]
    except ValueError:
        p.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if any(r < 1 for r in args.rows):
        p.error("--rows must be >= 1")
    args.models = (args.models or ("qwen2.5-vl-7b" if args.quick else "demo,qwen2.5-vl-7b")).split(",")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    return args


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_seconds(fn, device: str, repeats: int, inner: int) -> float:
    """Best over ``repeats`` of the mean of ``inner`` calls, each call synchronised."""
    for _ in range(2):
        fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
            sync(device)
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def copy_bandwidth(device: str, dtype) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted): 1 GiB on a GPU (far past its
    L2, 50-60 MB on Hopper, and long enough that a launch and a sync do not count), 64 MiB on the CPU."""
    size = 2**30 if str(device).startswith("cuda") else 64 * 2**20
    n = size // torch.tensor([], dtype=dtype).element_size()
    src = torch.randn(n, device=device).to(dtype)
    dst = torch.empty_like(src)
    t = best_seconds(lambda: dst.copy_(src), device, 5, 3)
    return 2 * src.numel() * src.element_size() / t


def cases(hidden: int, inter: int, hq: int, hk: int, d: int, rows: int, device: str, dtype):
    """(op, fused call, reference call, bytes moved, check) per op; ``check()`` compares the two on fresh
    copies of the inputs (the in-place ops rewrite theirs while they are timed)."""
    g = torch.Generator().manual_seed(rows)

    def rand(*shape):
        return torch.randn(shape, generator=g).to(dtype).to(device)

    def close(got, want) -> bool:
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
                   for a, b in zip(got, want))

    size = torch.tensor([], dtype=dtype).element_size()
    x, r, w = rand(rows, hidden), rand(rows, hidden), rand(hidden)
    gate_up = rand(rows, 2 * inter)
    qkv = rand(rows, (hq + 2 * hk) * d)
    angles = rand(rows, d // 2).float() * 10
    angles = torch.cat((angles, angles), dim=-1)  # pair i turns with i + d/2, as M-RoPE's tables do
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)  # a rotation: q and k keep their size when redone
    q = qkv[:, :hq * d].view(rows, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(rows, hk, d)
    xs, rs = x.clone(), r.clone()
    yield ("rms_norm", lambda: ops.rms_norm(x, w, 1e-6), lambda: reference.rms_norm(x, w, 1e-6),
           2 * rows * hidden * size, lambda: close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6)))
    yield ("add_rms_norm", lambda: ops.fused_add_rms_norm(xs, rs, w, 1e-6),
           lambda: reference.fused_add_rms_norm(x, r, w, 1e-6), 4 * rows * hidden * size,
           lambda: close(ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6),
                         reference.fused_add_rms_norm(x, r, w, 1e-6)))
    if device == "cuda":  # no CPU kernel: torch's vectorised silu and mul are faster there (csrc/fused_ops.cpp)
        yield ("silu_and_mul", lambda: ops.silu_and_mul(gate_up), lambda: reference.silu_and_mul(gate_up),
               3 * rows * inter * size, lambda: close(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)))
    yield ("rotary_qk", lambda: ops.rotary(q, k, cos, sin), lambda: reference.rotary(q, k, cos, sin),
           (2 * rows * (hq + hk) * d + 2 * rows * d) * size,
           lambda: close(reference.rotary(q, k, cos, sin), ops.rotary(q.clone(), k.clone(), cos, sin)))
    # rotary + the K/V write into a paged cache of 4x as many slots, rows on scattered slots
    v = qkv[:, (hq + hk) * d:].view(rows, hk, d)
    slots = torch.randperm(4 * rows, generator=g)[:rows].to(device)
    caches = [torch.zeros(4 * rows, hk, d, dtype=dtype, device=device) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]

    def cache_check() -> bool:
        got_q = ops.rotary_cache(q.clone(), k, v, cos, sin, *caches, slots)
        want_q = reference.rotary_cache(q.clone(), k, v, cos, sin, *ref_caches, slots)
        return close(got_q, want_q) and all(torch.equal(a, b) for a, b in zip(caches, ref_caches))

    if device == "cpu" and rows <= 64:  # decode attention over a 4096-token context per row, paged in 16s
        ctx, block = 4096, 16
        kv = [rand(rows * ctx, hk, d) for _ in range(2)]
        pages = torch.randperm(rows * ctx // block, generator=g).view(rows, ctx // block)
        dslots = (pages[:, :, None] * block + torch.arange(block)).reshape(rows, ctx).contiguous()
        dvalid = torch.ones(rows, ctx, dtype=torch.bool)
        qd = rand(rows, hq, d)
        yield ("decode_attn_4k", lambda: ops.paged_decode_attention(qd, *kv, dslots, dvalid, d ** -0.5),
               lambda: reference.paged_decode_attention(qd, *kv, dslots, dvalid, d ** -0.5),
               (2 * rows * ctx * hk * d) * size,
               lambda: close(ops.paged_decode_attention(qd, *kv, dslots, dvalid, d ** -0.5),
                             reference.paged_decode_attention(qd, *kv, dslots, dvalid, d ** -0.5)))
    yield ("rotary_kv_write", lambda: ops.rotary_cache(q, k, v, cos, sin, *caches, slots),
           lambda: reference.rotary_cache(q, k, v, cos, sin, *ref_caches, slots),
           (2 * rows * hq * d + 4 * rows * hk * d + 2 * rows * d) * size, cache_check)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    dtype = DTYPES[args.dtype or ("bfloat16" if device == "cuda" else "float32")]
    if not ops.native_available() or (device == "cuda" and not ops.build_info()["cuda"]):
        info = ops.build_info()
        print(f"bench_fused_ops: error: no native kernels for {device}: "
              f"{info.get('reason') or info.get('cuda_reason')}", file=sys.stderr)
        return 1
    if not ops.fused_enabled():
        print("bench_fused_ops: error: UNIFIEDSERVE_NO_FUSED_OPS is set", file=sys.stderr)
        return 1
    repeats = 3 if args.quick else 7
    bandwidth = copy_bandwidth(device, dtype)
    print(f"{device} {dtype}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; torch {torch.__version__}")
    print(f"{'model':<14} {'rows':>6} {'op':<13} {'fused us':>9} {'torch us':>9} {'speedup':>8} "
          f"{'fused GB/s':>10} {'of copy':>8}  ok")
    results = []
    for model in args.models:
        for rows in args.rows:
            for name, fused, ref, nbytes, check in cases(*MODELS[model], rows, device, dtype):
                inner = max(1, min(200, int(2e6 // max(nbytes, 1))))
                ok = check()
                t_fused = best_seconds(fused, device, repeats, inner)
                t_ref = best_seconds(ref, device, repeats, inner)
                gbps = nbytes / t_fused / 1e9
                results.append({"model": model, "rows": rows, "op": name, "fused_us": t_fused * 1e6,
                                "torch_us": t_ref * 1e6, "speedup": t_ref / t_fused, "bytes": nbytes,
                                "fused_GBps": gbps, "of_copy_bandwidth": gbps * 1e9 / bandwidth, "ok": ok})
                print(f"{model:<14} {rows:>6} {name:<13} {t_fused * 1e6:>9.1f} {t_ref * 1e6:>9.1f} "
                      f"{t_ref / t_fused:>7.2f}x {gbps:>10.1f} {gbps * 1e9 / bandwidth:>7.0%}  {'yes' if ok else 'NO'}")
    payload = {"device": device, "dtype": str(dtype), "torch": torch.__version__, "machine": platform.node(),
               "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
               "copy_bandwidth_GBps": bandwidth / 1e9, "results": results}
    out = args.out
    if out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / f"fused-ops-{device}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
