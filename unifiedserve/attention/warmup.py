"""Compile the attention kernels of a model's shapes once, before anything is timed or served.

flashinfer JIT-compiles each kernel configuration on first use (tens of seconds to minutes each on
a fresh machine) and caches it in ``~/.cache/flashinfer``. A run that only measures (``scripts/
gpu_check.sh``) warms them here first, so no timing and no test pays for a compilation.

Usage: ``python -m unifiedserve.attention.warmup [--model CHECKPOINT_DIR ...] [--preset NAME ...]
[--dtype bfloat16]``. A preset (``tiny``, the demo model, or a public one) needs no checkpoint: only
the shapes matter.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from unifiedserve.attention import KVCache, get_attention_backend
from unifiedserve.attention.varlen import fused_varlen_attention, resolve_varlen_impl


def warm_up(text, vision, dtype: torch.dtype, device: str = "cuda") -> dict[str, float]:
    """Warm the LLM's paged decode/prefill kernels for ``text`` (a ``TextConfig``) and the vision tower's
    fused attention for ``vision`` (a ``VisionConfig``).

    Returns:
        Seconds spent per part (``llm``, ``vision``); a part that uses no JIT kernel here costs ~0.
    Raises:
        ValueError: no CUDA.
    """
    if not torch.cuda.is_available():
        raise ValueError("warming attention kernels needs CUDA")
    times = {}
    start = time.perf_counter()
    cache = KVCache(1, 4, 16, text.num_key_value_heads, text.head_dim, dtype=dtype, device=device)
    backend = get_attention_backend(device, dtype=dtype, head_dim=text.head_dim)
    backend(cache, text.num_attention_heads, text.num_key_value_heads, text.head_dim).warmup()
    times["llm"] = time.perf_counter() - start
    start = time.perf_counter()
    warm_vision(vision, device, dtype)
    times["vision"] = time.perf_counter() - start
    return times


def warm_vision(vision, device: str | torch.device, dtype: torch.dtype) -> None:
    """Compile the vision tower's fused varlen attention for ``vision`` (a ``VisionConfig``) once; nothing
    where it uses no JIT kernel (the CPU's grouped SDPA)."""
    impl = resolve_varlen_impl("auto", torch.device(device), dtype)
    if impl != "grouped":
        heads, head_dim = vision.num_heads, vision.hidden_size // vision.num_heads
        q = torch.zeros((64, heads, head_dim), dtype=dtype, device=device)  # [rows, heads, head_dim]
        fused_varlen_attention(q, q, q, [16, 48], head_dim ** -0.5, impl)
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    from unifiedserve.model.config import ModelConfig
    from unifiedserve.model.demo import preset_shapes
    from unifiedserve.model.presets import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=[], metavar="DIR",
                        help="checkpoint folder (its config.json gives the shapes); repeat for several")
    parser.add_argument("--preset", action="append", default=[], choices=PRESETS,
                        help="a preset's shapes, no checkpoint needed (tiny: the demo model); repeat for several")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args(argv)
    if not args.model and not args.preset:
        parser.error("give at least one --model or --preset")
    parts = []
    try:
        shapes = [(name, *preset_shapes(name)) for name in args.preset]
        for folder in args.model:
            cfg = ModelConfig.from_json(folder)
            shapes.append((folder, cfg.text, cfg.vision))
        for name, text, vision in shapes:
            times = warm_up(text, vision, getattr(torch, args.dtype))
            parts.append(f"{name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    except (ValueError, OSError) as e:
        print(f"warmup: error: {e}", file=sys.stderr)
        return 1
    print("attention kernels warm: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
