#!/usr/bin/env python3
"""Engine benchmark: our paged engine vs transformers' Qwen2_5_VLForConditionalGeneration, CPU or CUDA.

Same checkpoint (the demo model unless --model, e.g. a preset written by
``unifiedserve demo-model --preset qwen2.5-vl-7b``), same inputs, same dtype, warm-ups excluded,
every device timing synchronized:
  - decode step latency and tokens/s at each --batches size (ours: engine steps after every
    request has its first token, CUDA graphs unless --enforce-eager; transformers: batched
    ``generate``, (N new tokens - 1 new token) / (N - 1)), against the floor: the bytes a step
    must read / the device-to-device copy bandwidth measured in this run;
  - prefill tokens/s, TFLOP/s and MFU of one --prefill-tokens chunk, against transformers' forward;
  - vision-tower patches/s, TFLOP/s and MFU on video slices, against transformers' visual forward;
  - with --json-schema: the cost of response_format (grammar-constrained decoding): the median decode
    step at each --batches size with every request under the schema vs the same requests without it
    (steps where the whole batch is still running; every constrained output must follow the grammar,
    and those that closed their JSON must parse and validate);
  - with --penalties: the cost of presence, frequency and repetition penalties (token counts kept on the
    device), the median decode step at each --batches size with every request penalized vs not;
  - on CUDA, last: each decode graph's kernels by kind, and (--profile-steps) what the device runs between two
    graph replays of async decode steps, op by op (``step_trace.py``): the step's cost outside its graph.
Correctness is checked before anything is timed: in float32 the greedy tokens must equal
transformers'; in bf16/fp16 the prefill's last-token logits must have cosine >= 0.99 with
transformers' (and the greedy agreement is reported); the vision outputs likewise. A check that
fails is recorded (``correctness_failed`` in the JSON), the timings still run (a device run is too
rare to lose), and the script exits 1 at the end. The JSON is written after every part, so a run
cut short by a time limit keeps what it measured.

    python bench/engine/bench_engine.py [--model PATH] [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16]
        [--short] [--parts decode,prefill,vision] [--json-schema [SCHEMA.json]] [--penalties]
        [--out DIR_OR_FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_metrics as em  # noqa: E402
from decode_overhead import (BENCH_SCHEMA, _json_schema_overhead, _penalty_overhead,  # noqa: E402
                             _start, _trace_async_steps)
from engine_parity import _long_agreement, cosine  # noqa: E402
from engine_report import _print, _throughput  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MIN_COSINE = 0.99


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: a fresh demo model)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, "
                                                   "float16")
    p.add_argument("--short", action="store_true", help="fewer tokens and repeats (the GPU check's time limit)")
    p.add_argument("--parts", default="decode,prefill,vision",
                   help="what to time, comma-separated, of decode, prefill, vision (default all; the correctness "
                        "checks always run)")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,64 on CUDA, 1,8,32 on CPU)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of decode requests (default 64)")
    p.add_argument("--prefill-tokens", type=int, default=None, help="prefill chunk (default 8192 CUDA, 1024 CPU)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill the --prefill-tokens prompt in chunks of this many tokens, each over the pages "
                        "of the ones before (as the server's chunked prefill does); transformers runs it whole")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default 32, short 16)")
    p.add_argument("--slices", type=int, default=None, help="video slices (392x728 frame pairs, 1456 patches each) "
                                                            "for vision (default 16 CUDA, 4 CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats of prefill/vision (default 5, short 3)")
    p.add_argument("--agreement-steps", type=int, default=None,
                   help="greedy decode steps checked token by token against transformers' top-1 on the same "
                        "sequence, and their logits' cosine (default 256; 0 skips)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for our decode")
    p.add_argument("--profile-steps", type=int, default=8,
                   help="CUDA with graphs: profile this many async decode steps at each batch size, last, and list "
                        "what the device runs between two graph replays (the step's cost outside its graph, op by "
                        "op: step_trace.py); 0 skips (default 8; at most --new-tokens minus 5)")
    p.add_argument("--async-scheduling", choices=("off", "on", "both"), default="off",
                   help="our decode steps launched before the previous one is read back (on), or timed both ways "
                        "in the same run (both: the sync step stays the headline, the async one beside it)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak for MFU (default: data sheet by GPU name)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json-schema", nargs="?", const="builtin", default=None, metavar="SCHEMA.json",
                   help="also time decode steps under response_format json_schema (this schema file, or a "
                        "built-in one) against unconstrained steps, and print the ratio")
    p.add_argument("--penalties", action="store_true",
                   help="also time decode steps with presence, frequency and repetition penalties on every request "
                        "against the same steps without, and print the ratio")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                   help="a folder (a timestamped JSON goes there) or a .json file")
    args = p.parse_args(argv)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(args.parts) - {"decode", "prefill", "vision"})
    if unknown or not args.parts:
        p.error(f"--parts takes decode, prefill and vision, got {', '.join(unknown) or 'nothing'}")
    for flag, given in (("--json-schema", args.json_schema is not None), ("--penalties", args.penalties)):
        if given and "decode" not in args.parts:
            p.error(f"{flag} times decode steps: keep decode in --parts")
    if args.profile_steps != 0 and args.profile_steps < 2:
        p.error(f"--profile-steps must be 0 or at least 2, got {args.profile_steps}")
    if args.agreement_steps is not None and args.agreement_steps < 0:
        p.error(f"--agreement-steps must be >= 0, got {args.agreement_steps}")
    for name in ("prompt_tokens", "prefill_tokens", "prefill_chunk", "new_tokens", "slices", "repeats"):
        value = getattr(args, name)
        if value is not None and value < (2 if name == "new_tokens" else 1):
            p.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'new_tokens' else 1}, got {value}")
    if args.json_schema is not None:
        if args.json_schema == "builtin":
            args.json_schema = BENCH_SCHEMA
        else:
            try:
                args.json_schema = json.loads(Path(args.json_schema).read_text())
            except (OSError, ValueError) as e:
                p.error(f"--json-schema: cannot read a JSON schema from {args.json_schema}: {e}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen2_5_VLForConditionalGeneration

    from unifiedserve.engine import LLM, EngineConfig, SamplingParams, SchedulerConfig
    from unifiedserve.engine.device import DTYPES, resolve_device, resolve_dtype
    from unifiedserve.engine.runner import forward_tokens
    from unifiedserve.model.demo import write_demo_model
    from unifiedserve.ops import skinny

    try:
        device_name = resolve_device(args.device)
        dtype_name = resolve_dtype(args.dtype, device_name)
    except ValueError as e:
        print(f"bench_engine: error: {e}", file=sys.stderr)
        return 1
    device = torch.device(device_name)
    cuda = device.type == "cuda"
    batches = [int(b) for b in (args.batches or ("1,8,64" if cuda else "1,8,32")).split(",")]
    prefill_tokens = args.prefill_tokens or (8192 if cuda else 1024)
    new_tokens = args.new_tokens or (16 if args.short else 32)
    slices = args.slices or (16 if cuda else 4)
    repeats = args.repeats or (3 if args.short else 5)
    dtype = DTYPES[dtype_name]
    model_path = args.model
    if model_path is None:
        model_path = Path(tempfile.mkdtemp()) / "demo-model"
        write_demo_model(model_path)
    max_batch = max(batches)
    agreement_steps = 256 if args.agreement_steps is None else args.agreement_steps
    # KV for the largest decode batch or the agreement's one long sequence, whichever holds more, beside the prefill
    total = (max(max_batch * (args.prompt_tokens + new_tokens), args.prompt_tokens + agreement_steps)
             + prefill_tokens + new_tokens)
    engine = LLM(model_path, EngineConfig(
        device=device_name, dtype=dtype_name, num_kv_blocks=total // 16 + 64, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling == "on",
        max_cuda_graph_batch=max_batch, scheduler=SchedulerConfig(
            prefill_token_budget=max(prefill_tokens, max_batch * args.prompt_tokens), max_num_seqs=max_batch)))
    # straight onto the GPU where accelerate can place it (no CPU copy of a 7B first), else built, then moved
    import importlib.util
    placed = {"device_map": device_name} if cuda and importlib.util.find_spec("accelerate") else {}
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_path, dtype=dtype, **placed).to(device).eval()
    model, runner = engine.model, engine.runner
    mc = engine.model_config
    # prompt ids below every special id: a drawn image or video placeholder would make a request with
    # placeholders and no media (refused), and ids the tokenizer knows keep detokenizing cheap
    special = min(mc.image_token_id, mc.video_token_id, mc.vision_start_token_id, mc.vision_end_token_id,
                  mc.bos_token_id, *mc.eos_token_ids)
    gen = torch.Generator().manual_seed(0)

    def prompt(n):
        return torch.randint(10, min(special, mc.text.vocab_size - 100), (n,), generator=gen).tolist()

    def hf_generate(prompts, n):
        with torch.no_grad():
            ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False)
        return out[:, len(prompts[0]):].tolist()

    def ours_prefill_logits(ids):
        blocks = list(range(-(-len(ids) // engine.config.block_size)))
        return forward_tokens(model, runner.attn, torch.tensor(ids), torch.arange(len(ids)).expand(3, -1),
                              [(0, len(ids), blocks)], None, [len(ids) - 1], torch.zeros(len(ids), dtype=torch.bool),
                              runner.rope)[0]

    def hf_prefill_logits(ids):
        with torch.no_grad():
            return hf(input_ids=torch.tensor([ids], device=device), logits_to_keep=1).logits[0, -1]

    # -- correctness first -------------------------------------------------------------------
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    check = prompt(args.prompt_tokens)
    ours_tokens = engine.generate([(check, [], params)])[0].token_ids
    hf_tokens = hf_generate([check], new_tokens)[0]
    agreement = sum(a == b for a, b in zip(ours_tokens, hf_tokens)) / new_tokens
    with torch.inference_mode():
        logit_cos = cosine(ours_prefill_logits(check), hf_prefill_logits(check))
    failed: list[str] = []  # correctness checks that failed: reported, and the exit status, at the end
    if dtype == torch.float32 and ours_tokens != hf_tokens:
        failed.append("float32 greedy tokens differ from transformers")
    if logit_cos < MIN_COSINE:
        failed.append(f"prefill logits cosine {logit_cos:.4f} < {MIN_COSINE} vs transformers")
    grid = [(1, 28, 52)] * slices  # one 392x728 frame pair per slice
    patches = torch.randn(sum(t * h * w for t, h, w in grid), runner.patch_buffer.dim, generator=gen).to(device, dtype)
    grid_t = torch.tensor(grid, device=device)

    def hf_visual():
        out = hf.model.visual(patches, grid_thw=grid_t)
        return out if torch.is_tensor(out) else out.pooler_output

    with torch.inference_mode():
        vision_cos = cosine(model.encode_vision(patches, grid), hf_visual())
    if vision_cos < MIN_COSINE:
        failed.append(f"vision output cosine {vision_cos:.4f} < {MIN_COSINE} vs transformers")
    results = {"correctness": {"greedy_agreement": agreement, "prefill_logits_cosine": logit_cos,
                               "vision_cosine": vision_cos, "tokens_checked": new_tokens},
               "correctness_failed": failed}
    config = {"model": str(model_path), "device": device_name, "dtype": dtype_name, "batches": batches,
              "prompt_tokens": args.prompt_tokens, "prefill_tokens": prefill_tokens,
              "prefill_chunk": args.prefill_chunk, "new_tokens": new_tokens,
              "slices": slices, "repeats": repeats, "short": args.short, "enforce_eager": args.enforce_eager,
              "async_scheduling": args.async_scheduling, "parts": args.parts,
              "json_schema": args.json_schema, "penalties": args.penalties}
    path = args.out if args.out.suffix == ".json" else args.out / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    machine = em.machine_info(device)

    def save():  # after every part: a run cut short keeps what it measured
        path.write_text(json.dumps({"machine": machine, "config": config, "results": results}, indent=2))

    save()
    if agreement_steps:
        results["correctness"].update(_long_agreement(engine, model, runner, hf, prompt(args.prompt_tokens),
                                                      agreement_steps, device, forward_tokens))
        save()

    # -- the floor: copy bandwidth and peak --------------------------------------------------
    bandwidth = em.copy_bandwidth(device, (1 << 30) if cuda else (1 << 28))
    peak, peak_source = em.peak_tflops(device, dtype_name, args.peak_tflops)
    results["device"] = {"copy_bandwidth_GBps": bandwidth / 1e9, "peak_tflops": peak, "peak_source": peak_source,
                         "cuda_graphs": runner.graphs is not None,
                         "attention_backend": type(runner.attn).__name__,
                         # cuBLAS vs the skinny kernel per projection and decode row count, timed at start-up
                         "skinny_gemm": [c.as_dict() for c in skinny.table()],
                         "skinny_gemm_tune_s": round(skinny.tune_seconds(), 2),  # compilations included
                         "skinny_gemm_enabled": skinny.enabled(),
                         # split-KV vs split-free decode attention graphs per batch size and length, timed at start-up
                         "decode_attention": [c.as_dict() for c in runner.decode_attention_tuning]}
    save()

    # -- decode --------------------------------------------------------------------------------
    def time_decode(prompts, overlap: bool) -> tuple[float, int]:
        """Seconds per decode step of ``prompts`` (prefill not timed) and the outputs produced meanwhile;
        per step is per token of each request, so sync and async steps compare (async's first call reads
        nothing back and its last one launches a row too many)."""
        engine.core.async_scheduling = overlap
        engine.generate([(p, [], SamplingParams(max_tokens=3, ignore_eos=True)) for p in prompts])  # warm-up
        _start(engine, prompts, params)
        em.sync(device)
        start, produced = time.perf_counter(), 0
        while engine.has_unfinished:
            produced += len(engine.step())
        return (time.perf_counter() - start) / (new_tokens - 1), produced

    decode = {}
    for batch in batches if "decode" in args.parts else ():
        prompts = [prompt(args.prompt_tokens) for _ in range(batch)]
        ours_s, produced = time_decode(prompts, args.async_scheduling == "on")
        async_s = time_decode(prompts, True)[0] if args.async_scheduling == "both" else None
        engine.core.async_scheduling = args.async_scheduling == "on"
        steps = new_tokens - 1
        # the same step's device time alone (graph replays back to back): the rest of a step is host work, what
        # overlapping the next step's scheduling with this one's kernels could hide
        graphed = runner.graphs is not None and runner.graphs.graph_size(batch) is not None
        graph_s = runner.graphs.replay_seconds(batch) if graphed else None
        hf_generate(prompts, 2)  # warm-up
        em.sync(device)
        t_one = em.median_seconds(lambda: hf_generate(prompts, 1), device, repeats, warmup=0)
        t_all = em.median_seconds(lambda: hf_generate(prompts, new_tokens), device, repeats, warmup=0)
        hf_s = (t_all - t_one) / (new_tokens - 1) if t_all > t_one else None  # None: noise swamped the steps
        floor_s = em.decode_bytes(model, batch, args.prompt_tokens + new_tokens // 2) / bandwidth
        decode[batch] = {"ours_step_ms": ours_s * 1e3, "ours_tokens_per_s": produced / (ours_s * steps),
                         "transformers_step_ms": hf_s and hf_s * 1e3,
                         "transformers_tokens_per_s": hf_s and batch / hf_s,
                         "speedup": hf_s and hf_s / ours_s, "floor_step_ms": floor_s * 1e3,
                         "vs_floor": ours_s / floor_s,
                         "graph_replay_ms": None if graph_s is None else graph_s * 1e3,
                         "host_ms": None if graph_s is None else (ours_s - graph_s) * 1e3,
                         "async_step_ms": None if async_s is None else async_s * 1e3,
                         "async_vs_floor": None if async_s is None else async_s / floor_s}
        results["decode"] = decode
        save()
        r = decode[batch]
        print(f"decode batch {batch}: ours {r['ours_step_ms']:.3f} ms ({r['vs_floor']:.2f}x floor), transformers "
              + (f"{r['transformers_step_ms']:.3f} ms" if hf_s else "not resolved"), flush=True)
    if args.json_schema is not None:
        try:
            results["json_schema"] = _json_schema_overhead(engine, args.json_schema, batches, prompt,
                                                           args.prompt_tokens, new_tokens)
        except ValueError as e:
            print(f"bench_engine: error: {e}", file=sys.stderr)
            return 1
        save()
    if args.penalties:
        try:
            results["penalties"] = _penalty_overhead(engine, batches, prompt, args.prompt_tokens, new_tokens)
        except ValueError as e:
            print(f"bench_engine: error: {e}", file=sys.stderr)
            return 1
        save()

    # -- prefill -------------------------------------------------------------------------------
    long_prompt = prompt(prefill_tokens)
    def ours_chunked_prefill(ids, chunk):
        blocks = list(range(-(-len(ids) // engine.config.block_size)))
        for start in range(0, len(ids), chunk):
            end = min(start + chunk, len(ids))
            logits = forward_tokens(model, runner.attn, torch.tensor(ids[start:end]),
                                    torch.arange(start, end).expand(3, -1), [(start, end - start, blocks)], None,
                                    [end - start - 1], torch.zeros(end - start, dtype=torch.bool), runner.rope)[0]
        return logits

    if "prefill" in args.parts:
        with torch.inference_mode():
            if args.prefill_chunk:
                chunked_cos = cosine(ours_chunked_prefill(long_prompt, args.prefill_chunk),
                                     hf_prefill_logits(long_prompt))
                if chunked_cos < MIN_COSINE:
                    failed.append(f"chunked prefill logits cosine {chunked_cos:.4f} < {MIN_COSINE} vs transformers")
                results["correctness"]["chunked_prefill_logits_cosine"] = chunked_cos
                ours_p = em.median_seconds(lambda: ours_chunked_prefill(long_prompt, args.prefill_chunk), device,
                                           repeats)
            else:
                ours_p = em.median_seconds(lambda: ours_prefill_logits(long_prompt), device, repeats)
            hf_p = em.median_seconds(lambda: hf_prefill_logits(long_prompt), device, repeats)
        flops = em.prefill_flops(engine.model_config.text, model.language_model.layers, prefill_tokens)
        results["prefill"] = _throughput(prefill_tokens, "tokens", ours_p, hf_p, flops, peak)
        results["prefill"]["chunk"] = args.prefill_chunk  # None: one forward, as transformers'
        save()

    # -- vision --------------------------------------------------------------------------------
    if "vision" in args.parts:
        with torch.inference_mode():
            ours_v = em.median_seconds(lambda: model.encode_vision(patches, grid), device, repeats)
            hf_v = em.median_seconds(hf_visual, device, repeats)
        flops = em.vit_flops(engine.model_config.vision, model.visual, grid)
        results["vision"] = _throughput(patches.shape[0], "patches", ours_v, hf_v, flops, peak)
        save()
        # where the tower's time goes (issue 13's ViT MFU): each attention kernel, and the parts alone
        results["vision"]["split"] = em.vision_split(model.visual, patches, grid, device, repeats)
        save()

    # -- kernels, last: what the device runs, by kind (the profiler is the one part that could take the process
    # down with it, so everything above is saved first) ---------------------------------------------------------
    if cuda:
        graphed = [b for b in decode if runner.graphs is not None and runner.graphs.graph_size(b) is not None]
        for batch in graphed:  # a decode graph's replay (it reruns the last step of its size)
            decode[batch]["graph_kernels"] = em.kernel_profile(runner.graphs.graph_for(batch).replay, device)
            save()
        # async steps, what runs between two replays: after the first token and 3 steps into the overlap
        profiled = min(args.profile_steps, new_tokens - 5)
        if args.profile_steps and profiled < 2:
            print(f"bench_engine: the async-step profile needs --new-tokens >= 7 (got {new_tokens}): skipped",
                  file=sys.stderr)
        for batch in graphed if profiled >= 2 else ():
            trace = _trace_async_steps(engine, [prompt(args.prompt_tokens) for _ in range(batch)], new_tokens,
                                       profiled, device)
            decode[batch]["async_trace"] = {**trace, "steps_profiled": profiled}
            save()
        if "vision" in results:  # one tower forward
            with torch.inference_mode():
                results["vision"]["kernels"] = em.kernel_profile(lambda: model.encode_vision(patches, grid), device,
                                                                 calls=2)
            save()
    usage = engine.pool_usage()
    if usage != {"kv_blocks_used": 0, "patch_pages_used": 0, "visual_pages_used": 0}:
        failed.append(f"pages still in use after every request finished: {usage}")
    save()

    _print(results, device_name, dtype_name)
    print(f"wrote {path}")
    for reason in failed:
        print(f"bench_engine: error: {reason} (the timings above ran anyway: read them as unverified)",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
