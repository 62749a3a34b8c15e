#!/usr/bin/env python3
"""Engine benchmark on CPU: our paged engine vs transformers' Qwen2_5_VLForConditionalGeneration.

Same model (the demo checkpoint unless --model), same requests, fp32, warmup excluded:
  - prefill tokens/s (one prompt);
  - decode tokens/s at batch 1 / 8 / 32, against transformers' one-request-at-a-time ``generate``
    (the issue's target: batched decode >= 3x that);
  - vision patches/s (the vision tower on video slices).
Greedy tokens are checked equal before anything is timed.

    python bench/engine/bench_engine.py [--model PATH] [--batches 1,8,32] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: a fresh demo model)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes (default 1,8,32)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of decode requests (default 64)")
    p.add_argument("--prefill-tokens", type=int, default=1024, help="prompt length for the prefill test")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--slices", type=int, default=4, help="video slices (392x728 frame pairs) for vision")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the JSON goes")
    return p.parse_args(argv)


def timed(fn):
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen2_5_VLForConditionalGeneration

    from flashcodec.benchmark import machine_info
    from unifiedserve.engine import LLM, EngineConfig, SamplingParams, SchedulerConfig
    from unifiedserve.model.demo import write_demo_model

    model_path = args.model
    if model_path is None:
        model_path = Path(tempfile.mkdtemp()) / "demo-model"
        write_demo_model(model_path)
    batches = [int(b) for b in args.batches.split(",")]
    max_batch = max(batches)
    total = max_batch * (args.prompt_tokens + args.new_tokens) + args.prefill_tokens + args.new_tokens
    engine = LLM(model_path, EngineConfig(num_kv_blocks=total // 16 + 64, scheduler=SchedulerConfig(
        prefill_token_budget=max(args.prefill_tokens, max_batch * args.prompt_tokens), max_num_seqs=max_batch)))
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32).eval()
    vocab = engine.model_config.text.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt(n):
        return torch.randint(10, vocab - 100, (n,), generator=gen).tolist()

    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)

    def hf_generate(ids):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False)
        return out[0, len(ids):].tolist()

    # correctness first
    check = prompt(args.prompt_tokens)
    ours = engine.generate([(check, [], params)])[0].token_ids
    assert ours == hf_generate(check), "greedy tokens differ from transformers: refusing to time"
    results = {}

    # prefill
    long_prompt = prompt(args.prefill_tokens)
    with torch.no_grad():
        hf(input_ids=torch.tensor([long_prompt]))  # warmup
        hf_prefill_s, _ = timed(lambda: hf(input_ids=torch.tensor([long_prompt])))
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([(long_prompt, [], one)])  # warmup
    our_prefill_s, _ = timed(lambda: engine.generate([(long_prompt, [], one)]))
    results["prefill_tokens_per_s"] = {"ours": args.prefill_tokens / our_prefill_s,
                                       "transformers": args.prefill_tokens / hf_prefill_s}

    # decode: time from the step where every request has its first token to the end
    hf_generate(check)  # warmup
    hf_s, _ = timed(lambda: [hf_generate(p) for p in [prompt(args.prompt_tokens) for _ in range(4)]])
    hf_tokens_per_s = 4 * args.new_tokens / hf_s
    decode = {}
    for batch in batches:
        prompts = [prompt(args.prompt_tokens) for _ in range(batch)]
        for ids in prompts:
            engine.add_request(ids, [], params)
        while any(not r.output_token_ids for r in engine.scheduler.requests.values()):
            engine.step()  # prefill
        start, produced = time.perf_counter(), 0
        while engine.has_unfinished:
            produced += len(engine.step())
        decode[batch] = produced / (time.perf_counter() - start)
    results["decode_tokens_per_s"] = {"ours": decode, "transformers_one_at_a_time": hf_tokens_per_s}

    # vision: video slices of a 392x728 frame pair (1456 patches each)
    grid = [(1, 28, 52)] * args.slices
    patches = torch.randn(sum(t * h * w for t, h, w in grid), 1176)
    with torch.no_grad():
        engine.model.encode_vision(patches, grid)
        ours_v, _ = timed(lambda: engine.model.encode_vision(patches, grid))
        hf.model.visual(patches, grid_thw=torch.tensor(grid))
        hf_v, _ = timed(lambda: hf.model.visual(patches, grid_thw=torch.tensor(grid)))
    results["vision_patches_per_s"] = {"ours": patches.shape[0] / ours_v, "transformers": patches.shape[0] / hf_v}
    assert engine.pool_usage() == {"kv_blocks_used": 0, "patch_pages_used": 0, "visual_pages_used": 0}

    print(f"{'metric':<34} {'ours':>10} {'transformers':>13} {'ratio':>7}")
    p = results["prefill_tokens_per_s"]
    print(f"{'prefill tokens/s':<34} {p['ours']:>10.0f} {p['transformers']:>13.0f} {p['ours'] / p['transformers']:>6.2f}x")
    for batch, tps in decode.items():
        print(f"{f'decode tokens/s, batch {batch}':<34} {tps:>10.0f} {hf_tokens_per_s:>13.0f} "
              f"{tps / hf_tokens_per_s:>6.2f}x")
    v = results["vision_patches_per_s"]
    print(f"{'vision patches/s':<34} {v['ours']:>10.0f} {v['transformers']:>13.0f} {v['ours'] / v['transformers']:>6.2f}x")
    print("(transformers decode: generate() one request at a time, the same tokens)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
                                "results": results}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
