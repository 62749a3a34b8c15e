"""What the skinny decode GEMM's tests compare against (unifiedserve/ops/skinny.py): the unfused path's arithmetic
in torch, its roundings emulated, rotary with the K/V write, a fake tune() timer, and a runner for scripts under
Triton's interpreter (which reads its environment when the kernel is built, hence a process of its own). Imported by
those scripts too, so it keeps to plain functions."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from unifiedserve.ops import reference

ROOT = Path(__file__).resolve().parents[3]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


def expected(x, w, b, silu_mul):
    """What the unfused path computes: the GEMM in float32 rounded once to the dtype, then silu_and_mul's
    roundings (torch's silu rounds, the product rounds)."""
    y = F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return reference.silu_and_mul(y) if silu_mul else y


def run_interpreted(script: str, timeout: int = 300) -> list[str]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = textwrap.dedent(script).format(root=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def expected_norm(x, residual, norm_weight, w, b, silu_mul, eps=1e-6):
    """The unfused path with the add + RMSNorm in front: ``(output, stream)``."""
    if residual is None:
        normed, stream = reference.rms_norm(x, norm_weight, eps), x
    else:
        normed, stream = reference.fused_add_rms_norm(x.clone(), residual.clone(), norm_weight, eps)
    return expected(normed, w, b, silu_mul), stream


def emulated_norm(x, residual, norm_weight, w, b, silu_mul, rnd, eps=1e-6):
    """The fused path's arithmetic in float32 torch with each rounding done by ``rnd`` (float32 -> the dtype): the
    add, 1 / sqrt(mean of squares + eps), the normalised value, the product with the weight, the GEMM's output(s),
    the SiLU, SwiGLU's product. ``(output, stream)``."""
    stream = x if residual is None else rnd(x.float() + residual.float())
    s = stream.float()
    inv = 1.0 / torch.sqrt((s * s).sum(-1, keepdim=True) / s.shape[-1] + eps)
    normed = rnd(norm_weight.float() * rnd(s * inv).float()).float()
    y = F.linear(normed, w.float(), None if b is None else b.float())
    if not silu_mul:
        return rnd(y), stream
    gate, up = (rnd(t).float() for t in y.chunk(2, dim=-1))
    return rnd(rnd(gate / (1.0 + torch.exp(-gate))).float() * up), stream


def truncated(t):
    """float32 -> bfloat16 as Triton's interpreter converts: dropping the low bits (the GPU rounds to nearest)."""
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def rope_reference(y, hq, hk, cos, sin, slot_mapping, write_rows, slots, rnd=None):
    """Rotary + the K/V write on the projection's output ``y [M, (Hq + 2 Hk) * D]``: ``(q [M, Hq * D], k_cache,
    v_cache)`` with unwritten slots NaN. ``rnd`` None: the unfused path (csrc's reference, rotary_cache); else its
    arithmetic in float32 with each rounding done by ``rnd``."""
    m, d = y.shape[0], cos.shape[1]
    q, k, v = (t.reshape(m, -1, d) for t in y.split([hq * d, hk * d, hk * d], -1))
    k_cache = torch.full((slots, hk, d), float("nan"), dtype=y.dtype)
    v_cache = k_cache.clone()
    if rnd is None:
        q = reference.rotary_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, write_rows)
        return q.reshape(m, -1), k_cache, v_cache

    def rotate(t):
        a, b = t.float().chunk(2, -1)
        c, s = cos.float()[:, None], sin.float()[:, None]
        half = d // 2
        lo = rnd(rnd(a * c[..., :half]).float() + rnd(-b * s[..., :half]).float())
        hi = rnd(rnd(b * c[..., half:]).float() + rnd(a * s[..., half:]).float())
        return torch.cat((lo, hi), -1)

    q, k = rotate(q), rotate(k)
    src = torch.arange(m) if write_rows is None else write_rows
    k_cache[slot_mapping] = k[src]
    v_cache[slot_mapping] = v[src]
    return q.reshape(m, -1), k_cache, v_cache


def fake_timer(times):
    """A tune() timer that runs the call once and returns the next of ``times`` (cuBLAS first, then each config)."""
    it = iter(times)

    def timer(run, repeats, device):
        run()
        return next(it)

    return timer
