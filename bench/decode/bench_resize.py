#!/usr/bin/env python3
"""GPU frame resize and patchify: flashcodec's fused Triton kernels vs the torch paths they reproduce.

For each (decoded size -> model size) it resizes a chunk of uint8 frames on the GPU both ways (the
reference: float32 copy, antialiased bicubic ``F.interpolate``, round, clamp, cast; the fused kernel:
one pass), checks that they agree (max |diff| <= 1 level), and prints frames/s, the ratio, and the
memory each needs beyond its input and output (the reference's float32 copies). Then the same for
normalise + patchify of the resized frames into bfloat16 patch rows (one kernel vs torch's reordering
copy and ``addcmul``).

    python bench/decode/bench_resize.py            # needs CUDA and Triton
    python bench/decode/bench_resize.py --quick    # the GPU check's setting
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flashcodec.patch_kernel import patches_fused  # noqa: E402
from flashcodec.patches import PatchSpec, frames_to_patches, patches_torch  # noqa: E402
from flashcodec.resize import resize_frames  # noqa: E402
from flashcodec.resize_kernel import fused_resize_available, resize_frames_fused  # noqa: E402

# decoded size -> the Qwen2.5-VL size of the issue's workloads (2 fps video at the default max_pixels)
CASES = [((1080, 1920), (392, 728)), ((720, 1280), (392, 728)), ((2160, 3840), (392, 728)), ((480, 854), (252, 448))]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=8, help="frames per call (NVDEC sessions resize 8 at a time)")
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="a folder or a .json file")
    args = p.parse_args(argv)
    if args.frames < 1:
        p.error("--frames must be >= 1")
    return args


def timed(fn, repeats: int) -> tuple[float, int]:
    """Best seconds per call, and the peak bytes allocated during one call beyond what was there."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, peak


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_resize: error: needs a CUDA GPU", file=sys.stderr)
        return 1
    if not fused_resize_available("cuda"):
        print("bench_resize: error: the fused resize is not available (is triton installed?)", file=sys.stderr)
        return 1
    repeats = 5 if args.quick else 20
    g = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, {args.frames} frames per call")
    print(f"{'resize':<24} {'fused fps':>10} {'torch fps':>10} {'speedup':>8} {'fused MB':>9} {'torch MB':>9} "
          f"{'max diff':>8} {'exact':>7}")
    rows, ok = [], True
    for (h0, w0), (h, w) in CASES:
        # as decoders hand frames over: NCHW viewed over channels-last memory (torchcodec permutes its HWC output)
        frames = torch.randint(0, 256, (args.frames, h0, w0, 3), generator=g,
                               dtype=torch.uint8).cuda().permute(0, 3, 1, 2)
        fused_s, fused_mem = timed(lambda: resize_frames_fused(frames, h, w), repeats)
        ref_s, ref_mem = timed(lambda: resize_frames(frames, h, w), repeats)
        diff = (resize_frames_fused(frames, h, w).int() - resize_frames(frames, h, w).int()).abs()
        worst, exact = int(diff.max()), float((diff == 0).float().mean())
        ok &= worst <= 1
        row = {"from": [h0, w0], "to": [h, w], "frames": args.frames, "fused_fps": args.frames / fused_s,
               "torch_fps": args.frames / ref_s, "speedup": ref_s / fused_s, "fused_extra_bytes": fused_mem,
               "torch_extra_bytes": ref_mem, "max_diff": worst, "exact_share": exact}
        rows.append(row)
        print(f"{f'{h0}x{w0} -> {h}x{w}':<24} {row['fused_fps']:>10.0f} {row['torch_fps']:>10.0f} "
              f"{row['speedup']:>7.2f}x {fused_mem / 1e6:>9.1f} {ref_mem / 1e6:>9.1f} {worst:>8} {exact:>7.4f}")
    print(f"\n{'patchify (bf16 rows)':<24} {'fused fps':>10} {'torch fps':>10} {'speedup':>8} {'max diff':>9}")
    patch_rows = []
    spec = PatchSpec()
    for _, (h, w) in CASES[::2]:
        small = torch.randint(0, 256, (args.frames, 3, h, w), generator=g, dtype=torch.uint8).cuda()
        ref_out, _ = frames_to_patches(small.cpu(), spec, dtype=torch.bfloat16)
        out_t = torch.empty_like(ref_out, device="cuda")

        fused_s, _ = timed(lambda: patches_fused(small, spec, out_t), repeats)
        diff = float((out_t.cpu().float() - ref_out.float()).abs().max())
        ref_s, _ = timed(lambda: patches_torch(small, spec, out_t), repeats)  # frames_to_patches's two passes
        ok &= diff <= 0.016  # one bf16 step at the values' scale
        row = {"size": [h, w], "frames": args.frames, "fused_fps": args.frames / fused_s,
               "torch_fps": args.frames / ref_s, "speedup": ref_s / fused_s, "max_diff": diff}
        patch_rows.append(row)
        print(f"{f'{h}x{w}':<24} {row['fused_fps']:>10.0f} {row['torch_fps']:>10.0f} {row['speedup']:>7.2f}x "
              f"{diff:>9.4f}")
    out = args.out
    if out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / f"resize-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                               "patchify": patch_rows}, indent=2))
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
