"""Compile the attention kernels of a model's shapes once, before anything is timed or served.

flashinfer JIT-compiles each kernel configuration on first use (tens of seconds to minutes each on
a fresh machine) and caches it in ``~/.cache/flashinfer``. A run that only measures (``scripts/
gpu_check.sh``) warms them here first, so no timing and no test pays for a compilation.

Usage: ``python -m unifiedserve.attention.warmup --model CHECKPOINT_DIR [--dtype bfloat16]``
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from unifiedserve.attention import KVCache, get_attention_backend
from unifiedserve.attention.varlen import fused_varlen_attention, resolve_varlen_impl


def warm_up(model_dir: str, dtype: torch.dtype, device: str = "cuda") -> dict[str, float]:
    """Warm the LLM's paged decode/prefill kernels and the vision tower's fused attention.

    Returns:
        Seconds spent per part (``llm``, ``vision``); a part that uses no JIT kernel here costs ~0.
    Raises:
        ValueError: no CUDA, or a checkpoint folder without ``config.json``.
    """
    from unifiedserve.model.config import ModelConfig

    if not torch.cuda.is_available():
        raise ValueError("warming attention kernels needs CUDA")
    cfg = ModelConfig.from_json(model_dir)
    text, vision = cfg.text, cfg.vision
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder (its config.json gives the shapes)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args(argv)
    try:
        times = warm_up(args.model, getattr(torch, args.dtype))
    except (ValueError, OSError) as e:
        print(f"warmup: error: {e}", file=sys.stderr)
        return 1
    print("attention kernels warm: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
