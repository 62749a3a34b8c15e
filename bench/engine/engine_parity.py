"""Agreement of bench_engine.py's engine with transformers: logits cosine, and greedy tokens against
transformers' top-1 on the same sequence (read against float32 transformers when the run is bf16 or fp16)."""

from __future__ import annotations

import torch


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _long_agreement(engine, model, runner, hf, ids: list[int], steps: int, device, forward_tokens) -> dict:
    """Issue 13's bf16 check: ``steps`` greedy tokens of ours (the decode path, CUDA graphs included), then
    transformers on the same sequence (teacher-forced): the share of our tokens that are its top-1, and the
    cosine of the two models' logits at each of those positions (ours from one prefill of the sequence)."""
    from unifiedserve.engine import SamplingParams

    out = engine.generate([(ids, [], SamplingParams(max_tokens=steps, ignore_eos=True))])[0].token_ids
    full = ids + out
    rows = list(range(len(ids) - 1, len(full) - 1))  # the position that predicts each generated token
    with torch.inference_mode():
        blocks = list(range(-(-len(full) // engine.config.block_size)))
        ours = forward_tokens(model, runner.attn, torch.tensor(full), torch.arange(len(full)).expand(3, -1),
                              [(0, len(full), blocks)], None, rows, torch.zeros(len(full), dtype=torch.bool),
                              runner.rope).float()  # [steps, vocab]
        theirs = hf(input_ids=torch.tensor([full], device=device)).logits[0, rows].float()  # [steps, vocab]
    top1 = theirs.argmax(-1).tolist()
    cos = torch.nn.functional.cosine_similarity(ours, theirs.to(ours.device), dim=-1)
    result = {"agreement_steps": steps, "top1_agreement": sum(a == b for a, b in zip(out, top1)) / steps,
              "logits_cosine_min": float(cos.min()), "logits_cosine_mean": float(cos.mean())}
    if next(hf.parameters()).dtype != torch.float32:
        result.update(_float32_reference(hf, full, rows, out, top1, device))
    return result


def _float32_reference(hf, full: list[int], rows: list[int], ours: list[int], theirs: list[int], device) -> dict:
    """How far bf16 itself moves the top-1 on this sequence: transformers in float32 (its weights upcast in place,
    then given back their own dtypes: bf16 -> fp32 -> bf16 is exact) is the truth both bf16 (or fp16) models are read
    against.

    Random weights give near-uniform logits whose top two nearly tie, so bf16's rounding flips some top-1s in any
    implementation: ``transformers_top1_vs_float32`` is the reference's own share (in the run's dtype), beside ours
    (``top1_vs_float32``). ``tie_margins`` are float32's top-1 minus top-2 logit where ours differs from it.
    """
    tensors = [t for _, t in hf.named_parameters()] + [t for _, t in hf.named_buffers()]
    dtypes = [t.dtype for t in tensors]
    try:
        for t in tensors:
            if t.is_floating_point():
                t.data = t.data.float()
        with torch.inference_mode():
            truth = hf(input_ids=torch.tensor([full], device=device)).logits[0, rows].float()  # [steps, vocab]
    finally:
        for t, dtype in zip(tensors, dtypes):
            t.data = t.data.to(dtype)
    best = truth.argmax(-1).tolist()
    top2 = truth.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]  # [steps]
    steps = len(rows)
    return {"top1_vs_float32": sum(a == b for a, b in zip(ours, best)) / steps,
            "transformers_top1_vs_float32": sum(a == b for a, b in zip(theirs, best)) / steps,
            "tie_margins": [round(m, 4) for a, b, m in zip(ours, best, gaps.tolist()) if a != b][:16],
            "median_margin": float(gaps.median())}
