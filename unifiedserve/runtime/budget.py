"""Token budgets from a TBT SLO: a short start-up profile of core's iteration time, cached.

Core serialises encode and prefill and bounds each iteration's work (Algorithm 3), so the
interference an iteration can cause on the decode process sharing the device is bounded by its
length. The derivation picks the largest prefill budget tau whose prefill iteration (one chunk of
tau tokens) and the largest encode budget alpha whose encode iteration (alpha patch tokens) each
take at most the SLO: doubling until the SLO is passed, then bisecting. Results are cached in
``~/.cache/unifiedserve/budgets.json`` per model, device, dtype, thread count and SLO, and on a GPU per GPU
name, policy and core's MPS SM share (a profile of an uncapped core is not one of a capped core).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from unifiedserve.engine.runner import forward_tokens

log = logging.getLogger("unifiedserve")

CACHE_FILE = Path("~/.cache/unifiedserve/budgets.json")
TAU_RANGE = (16, 16384)
ALPHA_RANGE = (64, 65536)


def largest_within(measure, limit_s: float, lo: int, hi: int, step: int, probes: int = 5) -> int:
    """Largest ``n`` in ``[lo, hi]`` (a multiple of ``step``) with ``measure(n) <= limit_s``; ``lo`` if none.

    Assumes ``measure`` grows with ``n``: doubles from ``lo`` until the limit is passed, then
    bisects ``probes`` times.
    """
    ok, n = None, lo
    while n <= hi:
        if measure(n) > limit_s:
            break
        ok, n = n, n * 2
    if ok is None:
        return lo
    bad = min(n, hi + step)
    for _ in range(probes):
        mid = (ok + bad) // 2 // step * step
        if mid <= ok or mid >= bad:
            break
        if measure(mid) <= limit_s:
            ok = mid
        else:
            bad = mid
    return ok


def _time(fn, device: torch.device, repeats: int = 2) -> float:
    """Best wall time of ``fn`` over ``repeats`` runs after a warm-up; on CUDA until its kernels have run (they
    are only launched when ``fn`` returns)."""
    wait = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda _: None)
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        wait(device)
        start = time.perf_counter()
        fn()
        wait(device)
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def prefill_seconds(runner, num_tokens: int) -> float:
    """One prefill iteration of ``num_tokens`` text tokens from an empty cache (KV blocks from 0)."""
    bs = runner.block_size
    blocks = list(range(-(-num_tokens // bs)))
    if len(blocks) > runner.kv_cache.num_blocks:
        return math.inf
    ids = torch.randint(0, 1000, (num_tokens,))
    positions = torch.arange(num_tokens).expand(3, -1)
    return _time(lambda: forward_tokens(runner.model, runner.attn, ids, positions, [(0, num_tokens, blocks)],
                                        None, [num_tokens - 1], rope=runner.rope), runner.device)


@torch.inference_mode()
def encode_seconds(runner, num_patches: int) -> float:
    """One vision-encoder iteration over ``num_patches`` patch tokens (one image-like grid)."""
    side = max(2, int(math.sqrt(num_patches)) // 2 * 2)
    h, w = side, max(2, num_patches // side // 2 * 2)
    dim = runner.patch_buffer.dim
    patches = torch.zeros(h * w, dim, dtype=runner.dtype, device=runner.device)
    return _time(lambda: runner.model.encode_vision(patches, [(1, h, w)]), runner.device)


def _cache_key(cfg) -> str:
    """What the timings depend on: the model's files, device and dtype, core's threads, and on a GPU its name and
    core's SM share (MPS), which differ by policy (unified caps core at 100 - --decode-sm-percent, monolithic not)."""
    model = Path(cfg.model).resolve()
    stamp = [f"{p.name}:{p.stat().st_mtime_ns}" for p in sorted(model.glob("*.safetensors"))]
    gpu = torch.cuda.get_device_name() if str(cfg.engine.device).startswith("cuda") and torch.cuda.is_available() \
        else None
    share = cfg.process_env.get("core", {}).get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    raw = json.dumps([str(model), stamp, cfg.engine.device, cfg.engine.dtype, torch.get_num_threads(), cfg.tbt_slo_ms,
                      cfg.policy, gpu, share])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def derive_budgets(runner, cfg, base):
    """``(SchedulerConfig, description)`` with tau and alpha derived from ``cfg.tbt_slo_ms``."""
    path = CACHE_FILE.expanduser()
    key = _cache_key(cfg)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        tau, alpha = cache[key]["tau"], cache[key]["alpha"]
        how = f"cached profile for a {cfg.tbt_slo_ms} ms TBT SLO"
    else:
        start = time.perf_counter()
        limit = cfg.tbt_slo_ms / 1000
        tau = largest_within(lambda n: prefill_seconds(runner, n), limit, *TAU_RANGE, step=16)
        alpha = largest_within(lambda n: encode_seconds(runner, n), limit, *ALPHA_RANGE, step=64)
        how = f"profiled for a {cfg.tbt_slo_ms} ms TBT SLO in {time.perf_counter() - start:.1f} s"
        cache[key] = {"tau": tau, "alpha": alpha, "slo_ms": cfg.tbt_slo_ms, "model": str(cfg.model)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError as e:
            log.warning("could not cache the budget profile in %s: %s", path, e)
    derived = {"prefill_token_budget": tau, "encode_token_budget": alpha}
    derived.update(cfg.budget_overrides)
    log.info("budgets: tau=%d alpha=%d (%s)", derived["prefill_token_budget"], derived["encode_token_budget"], how)
    return replace(base, **derived), how
