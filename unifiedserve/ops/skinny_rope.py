"""The skinny GEMM's Q/K/V epilogue (:func:`unifiedserve.ops.skinny_kernel.skinny_gemm` with ``rope=``): rotary on
Q and K and the K/V write into the paged cache, in the projection's own kernel.

Why. At decode batch sizes the unfused path runs, per layer, the Q/K/V GEMM and then ``rotary_cache`` (csrc's
kernel: rotary, then the write), whose launch and dependency gap cost more than the few KB it moves: on the H100
(2026-11-26, 7B preset, batch 1, docs/gpu.md) the replay's norm/rotary/activation kernels took 298 us over 113
launches. Folded into the GEMM's epilogue, each program rotates the column pairs it has just summed and stores
them where they go. The arithmetic is the unfused path's: the GEMM's output rounded to the dtype, then
``csrc/fused_ops.h``'s ``rotate_pair`` (each product and the sum rounded to the tables' dtype).

What it takes (checked here, metadata only: nothing is read on the host):

- the weight's rows are ``[Hq | Hk | Hk]`` heads of ``D`` (Qwen2's fused ``qkv_proj``), D even;
- ``cos``/``sin`` ``[M, D]`` in the model's dtype (the language model's tables; a float32 table would need
  rounding-exact float32 arithmetic the compiler may contract into FMAs);
- caches ``[slots, Hk, D]`` contiguous in the model's dtype, ``slot_mapping`` int64 ``[M]`` (a slot outside the
  cache is not written, as csrc's kernel skips it);
- ``write_rows`` int64 ``[M]`` or None: row ``m`` writes its K/V only where ``write_rows[m] == m``. The unfused
  kernel writes row ``write_rows[m]``'s K/V into ``slot_mapping[m]``; the engine's padded CUDA-graph steps
  (``unifiedserve.attention.metadata``) map a padding row to row 0 *and* to row 0's slot, which row 0 writes
  itself, so both write the same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["RopeWrite", "tune_rope"]


@dataclass(frozen=True)
class RopeWrite:
    """Where the Q/K/V epilogue's rotary tables come from and its K/V go (see the module docstring)."""

    cos: torch.Tensor  # [M, D]
    sin: torch.Tensor  # [M, D]
    q_heads: int
    kv_heads: int
    k_cache: torch.Tensor  # [slots, Hk, D]
    v_cache: torch.Tensor  # [slots, Hk, D]
    slot_mapping: torch.Tensor  # int64 [M]
    write_rows: torch.Tensor | None = None  # int64 [M]

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[-1]

    def check(self, x: torch.Tensor, weight_rows: int) -> None:
        """``ValueError`` unless this write suits a call on ``x [M, K]`` with a weight of ``weight_rows`` rows."""
        m = x.shape[0]
        d = self.head_dim
        if self.q_heads < 1 or self.kv_heads < 1 or self.q_heads % self.kv_heads:
            raise ValueError(f"need q_heads a multiple of kv_heads >= 1, got {self.q_heads} and {self.kv_heads}")
        if d % 2 or d < 2:
            raise ValueError(f"the head dim must be even, got {d}")
        if weight_rows != (self.q_heads + 2 * self.kv_heads) * d:
            raise ValueError(f"a Q/K/V weight of {self.q_heads}+2x{self.kv_heads} heads of {d} has "
                             f"{(self.q_heads + 2 * self.kv_heads) * d} rows, got {weight_rows}")
        for name, t in (("cos", self.cos), ("sin", self.sin)):
            if t.shape != (m, d) or t.dtype != x.dtype or t.stride(1) != 1 or t.stride(0) != self.cos.stride(0):
                raise ValueError(f"{name} must be [{m}, {d}] {x.dtype} with contiguous rows (cos's stride), got "
                                 f"{list(t.shape)} {t.dtype} with strides {t.stride()}")
        for name, t in (("k_cache", self.k_cache), ("v_cache", self.v_cache)):
            if t.dim() != 3 or t.shape[1:] != (self.kv_heads, d) or t.dtype != x.dtype or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous [slots, {self.kv_heads}, {d}] {x.dtype}, got "
                                 f"{list(t.shape)} {t.dtype}")
        if self.v_cache.shape[0] != self.k_cache.shape[0]:
            raise ValueError(f"k_cache has {self.k_cache.shape[0]} slots, v_cache {self.v_cache.shape[0]}")
        for name, t in (("slot_mapping", self.slot_mapping), ("write_rows", self.write_rows)):
            if t is not None and (t.shape != (m,) or t.dtype != torch.int64 or t.stride(0) != 1):
                raise ValueError(f"{name} must be contiguous int64 [{m}], got {list(t.shape)} {t.dtype}")
        tensors = (self.cos, self.sin, self.k_cache, self.v_cache, self.slot_mapping, self.write_rows)
        if any(t is not None and t.device != x.device for t in tensors):
            raise ValueError("cos, sin, the caches, slot_mapping and write_rows must be on x's device")


def tune_rope(group, counts: Sequence[int], configs, margin: float, failed: dict,
              per_layer_us: Callable[[Callable[[], None], int], float]) -> tuple[list, list]:
    """:func:`unifiedserve.ops.skinny.tune`'s last passes for a Q/K/V group with ``rope_heads``. At each row count the
    baseline is :func:`~unifiedserve.ops.skinny.norm_linear` (with the choices the earlier passes just made) followed
    by csrc's ``rotary_cache``, and two ways of folding rotary and the K/V write into the projection are timed
    against it:

    - ``norm+<kind>+rope``: each config with the add + RMSNorm folded in too (one kernel a layer);
    - ``<kind>+rope``: the norm kernel, then each config with rotary and the K/V write only. On the H100
      (2026-11-27, 7B preset, docs/gpu.md) the norm in the kernel's prologue cost more (19.4 us against the norm
      kernel and cuBLAS's 16.9 at batch 1) than the rotary in its epilogue (0.6 us against ``rotary_cache``'s 3.0),
      so this form keeps the cheaper half of the fusion.

    Each is timed as a padded CUDA-graph step runs it (``write_rows`` given); a winner is then also checked in the
    forms a step runs but the timing does not: without a residual (the first layer) and without ``write_rows``
    (eager steps). Where both forms win at a row count, only the faster stays chosen.
    Returns the :class:`~unifiedserve.ops.skinny.Choice` lists ``(norm folded in, norm kernel in front)``, one
    entry per row count each; the caller keeps them."""
    from unifiedserve import ops
    from unifiedserve.ops import skinny
    from unifiedserve.ops.tuning import first_line

    w0, b0 = group.weights[0], group.biases[0]
    q_heads, kv_heads = group.rope_heads
    k = w0.shape[1]
    d = w0.shape[0] // (q_heads + 2 * kv_heads)
    sizes = [q_heads * d, kv_heads * d, kv_heads * d]
    layers = list(zip(group.weights, group.biases, group.norms))
    dev, dt = w0.device, w0.dtype
    rng = torch.Generator(device=dev).manual_seed(1)  # the same inputs at every start-up
    folded, behind = [], []
    for m in counts:
        x, residual = (torch.randn((m, k), generator=rng, device=dev).to(dt) for _ in range(2))
        angles = torch.rand((m, d // 2), generator=rng, device=dev) * 6.3
        cos, sin = torch.cat((angles, angles), -1).cos().to(dt), torch.cat((angles, angles), -1).sin().to(dt)
        slots = torch.arange(m, dtype=torch.int64, device=dev)
        k_fused, v_fused, k_base, v_base, k_want, v_want = (torch.zeros((m, kv_heads, d), dtype=dt, device=dev)
                                                            for _ in range(6))
        write = RopeWrite(cos, sin, q_heads, kv_heads, k_fused, v_fused, slots, write_rows=slots)  # each row its own
        stream, q_out = torch.empty_like(x), torch.empty((m, sizes[0]), dtype=dt, device=dev)

        def unfused(x, residual, w, b, g, k_cache, v_cache):
            qkv, h = skinny.norm_linear(x, residual, g, group.eps, w, b)
            q, kk, v = (t.view(m, -1, d) for t in qkv.split(sizes, dim=-1))
            return ops.rotary_cache(q, kk, v, cos, sin, k_cache, v_cache, slots), h

        w_last, b_last, g_last = layers[-1]
        q_want, stream_want = unfused(x.clone(), residual.clone(), w_last, b_last, g_last, k_want, v_want)
        k_first, v_first = torch.zeros_like(k_want), torch.zeros_like(v_want)
        q_first, _ = unfused(x.clone(), None, w_last, b_last, g_last, k_first, v_first)  # no residual: layer 0

        def baseline(bufs=(x.clone(), residual.clone()), k_base=k_base, v_base=v_base):
            xb, rb = bufs  # the unfused path writes its inputs: buffers of its own
            for w, b, g in layers:
                unfused(xb, rb, w, b, g, k_base, v_base)

        def wrong(q_got, k_got, v_got, wants, stream_got=None):
            """Why the outputs differ from ``wants`` (Q, K, V, and the stream), or ''."""
            pairs = [(q_got, wants[0].reshape(m, -1)), (k_got, wants[1]), (v_got, wants[2])]
            if stream_got is not None:
                pairs.append((stream_got, stream_want))
            return next((w for w in (skinny._disagreement(got, want) for got, want in pairs) if w), "")

        def run(config, x=x, residual=residual, stream=stream, q_out=q_out, write=write):
            for w, b, g in layers:
                skinny.skinny_gemm(x, w, b, norm_weight=g, eps=group.eps, residual=residual, stream_out=stream,
                                   rope=write, config=config, out=q_out)

        def verify(config, x=x, residual=residual, stream=stream, q_out=q_out, write=write, wants=(
                (q_want, k_want, v_want), (q_first, k_first, v_first))):
            for res, rows in ((None, write.write_rows), (residual, None), (None, None)):
                for t in (q_out, write.k_cache, write.v_cache):
                    t.fill_(float("nan"))
                skinny.skinny_gemm(x, w_last, b_last, norm_weight=g_last, eps=group.eps, residual=res,
                                   stream_out=None if res is None else stream, config=config, out=q_out,
                                   rope=RopeWrite(cos, sin, q_heads, kv_heads, write.k_cache, write.v_cache, slots,
                                                  write_rows=rows))
                why = wrong(q_out, write.k_cache, write.v_cache, wants[res is None])
                if why:
                    return f"{'without the add' if res is None else 'with the add'}, " \
                           f"{'with' if rows is not None else 'without'} write_rows, {why}"
            return ""

        baseline()
        name = "norm_linear + rotary_cache"
        folded.append(skinny._best(f"norm+{group.kind}+rope", m, w0.shape[0], k, name,
                                   per_layer_us(baseline, len(layers)), run,
                                   lambda _: wrong(q_out, k_fused, v_fused, (q_want, k_want, v_want), stream), configs,
                                   (b0 is not None, False, True, "rope"), failed,
                                   lambda f: per_layer_us(f, len(layers)), margin, (q_out, k_fused, v_fused, stream),
                                   verify))

        # the norm kernel in front: a step's own norm kernel (it writes its inputs, so the timed layers run on
        # buffers of their own and the check runs the config once more on fresh ones, the last layer's)
        bufs = (x.clone(), residual.clone())

        def run_behind(config, bufs=bufs, q_out=q_out, write=write):
            for w, b, g in layers:
                normed, _ = ops.fused_add_rms_norm(*bufs, g, group.eps)
                skinny.skinny_gemm(normed, w, b, rope=write, config=config, out=q_out)

        def behind_once(config, rows, q_out=q_out, write=write):
            """The last layer's norm kernel, then ``config`` with ``write_rows=rows``, on fresh inputs: why its
            outputs are wrong, or ''. (The first layer's form, without the add, differs only in the norm kernel.)"""
            for t in (q_out, write.k_cache, write.v_cache):
                t.fill_(float("nan"))
            normed, _ = ops.fused_add_rms_norm(x.clone(), residual.clone(), g_last, group.eps)
            skinny.skinny_gemm(normed, w_last, b_last, config=config, out=q_out,
                               rope=RopeWrite(cos, sin, q_heads, kv_heads, write.k_cache, write.v_cache, slots,
                                              write_rows=rows))
            return wrong(q_out, write.k_cache, write.v_cache, (q_want, k_want, v_want))

        def verify_behind(config):
            why = behind_once(config, None)  # eager steps: no write_rows
            return why and f"without write_rows, {why}"

        try:
            baseline()
            behind.append(skinny._best(f"{group.kind}+rope", m, w0.shape[0], k, name,
                                       per_layer_us(baseline, len(layers)), run_behind,
                                       lambda config: behind_once(config, slots), configs,
                                       (b0 is not None, False, False, "rope"), failed,
                                       lambda f: per_layer_us(f, len(layers)), margin, (q_out, k_fused, v_fused),
                                       verify_behind))
        except Exception as e:  # its baseline cannot be timed again: this form is not chosen, the others stand
            skinny._raise_if_fault(e, f"{group.kind}+rope", None)
            why = first_line(e)
            skinny.log.warning("skinny GEMM %s+rope, %d rows: not timed, the other forms stay: %s", group.kind, m, why)
            behind.append(dataclasses.replace(folded[-1], kind=f"{group.kind}+rope", skinny_us=None, config=None,
                                              configs_us={}, note=f"not timed: {why}"))
        in_one, after_norm = folded[-1], behind[-1]
        if in_one.chosen and after_norm.chosen:  # both beat the baseline: the faster stays
            note = skinny.RIVAL_FASTER
            if in_one.skinny_us <= after_norm.skinny_us:
                behind[-1] = dataclasses.replace(after_norm, config=None, note=note)
            else:
                folded[-1] = dataclasses.replace(in_one, config=None, note=note)
    return folded, behind
