"""bench_engine.py's report: the throughput rows (ours vs transformers, TFLOP/s, MFU) and the printed tables."""

from __future__ import annotations

import engine_metrics as em  # bench/engine is on the path here
import step_trace


def _throughput(units: int, unit: str, ours_s: float, hf_s: float, flops: float, peak: float | None) -> dict:
    out = {f"{unit}": units, f"ours_{unit}_per_s": units / ours_s, f"transformers_{unit}_per_s": units / hf_s,
           "speedup": hf_s / ours_s, "flops": flops, "ours_tflops": flops / ours_s / 1e12,
           "transformers_tflops": flops / hf_s / 1e12}
    if peak:
        out["ours_mfu"] = out["ours_tflops"] / peak
        out["transformers_mfu"] = out["transformers_tflops"] / peak
    return out


def _print(results: dict, device: str, dtype: str) -> None:
    d = results["device"]
    print(f"{device}, {dtype}, {d['attention_backend']}, CUDA graphs: {d['cuda_graphs']}; copy bandwidth "
          f"{d['copy_bandwidth_GBps']:.0f} GB/s; peak {d['peak_tflops']} TFLOP/s ({d['peak_source']})")
    if d.get("skinny_gemm"):
        print(f"decode GEMMs timed at start-up in {d.get('skinny_gemm_tune_s', 0.0):.1f} s (compilations included):")
    for c in d.get("skinny_gemm", []):  # what start-up timed, per projection and decode row count
        chosen = c["config"] or c.get("note") or "not chosen"
        best = "-" if c["skinny_us"] is None else f"{c['skinny_us']:.1f} us ({chosen})"
        print(f"GEMM {c['kind']:<23} [{c['n']}x{c['k']}] rows {c['rows']:>2}: {c.get('baseline', 'cuBLAS')} "
              f"{c['cublas_us']:.1f} us, skinny {best}")
    for c in d.get("decode_attention", []):  # 28 layers' decode attention in one graph, per batch size and length
        timed = ", ".join(f"{n}: {a:.1f}/{b:.1f}" for n, a, b in zip(c["lengths"], c["split_us"], c["whole_us"]))
        kept = f"split-free up to {c['whole_kv_max']} tokens" if c["whole_kv_max"] else "split-KV only"
        print(f"decode attention, batch {c['batch_size']:>2}: {kept} (tokens: split/split-free us: {timed})"
              + (f"; {c['note']}" if c.get("note") else ""))
    c = results["correctness"]
    print(f"correctness: greedy agreement {c['greedy_agreement']:.3f}, prefill logits cosine "
          f"{c['prefill_logits_cosine']:.5f}, vision cosine {c['vision_cosine']:.5f}")
    if "top1_agreement" in c:
        print(f"{c['agreement_steps']} greedy steps vs transformers' top-1 on the same sequence: "
              f"{c['top1_agreement']:.3f}; logits cosine min {c['logits_cosine_min']:.5f}, "
              f"mean {c['logits_cosine_mean']:.5f}")
    if "top1_vs_float32" in c:
        print(f"the same steps vs transformers float32's top-1: ours {c['top1_vs_float32']:.3f}, transformers {dtype} "
              f"{c['transformers_top1_vs_float32']:.3f} ({dtype}'s own flips); float32's top-1 - top-2 logit "
              f"where ours differs: {c['tie_margins']} (median over all steps {c['median_margin']:.3f})")
    decode = results.get("decode", {})
    if decode:
        print(f"{'decode':<10} {'ours ms':>9} {'tok/s':>9} {'hf ms':>9} {'hf tok/s':>9} {'speedup':>8} "
              f"{'floor ms':>9} {'x floor':>8}")
    for batch, r in decode.items():
        hf = (f"{r['transformers_step_ms']:>9.2f} {r['transformers_tokens_per_s']:>9.0f} {r['speedup']:>7.2f}x"
              if r["transformers_step_ms"] is not None else f"{'-':>9} {'-':>9} {'-':>8}")
        print(f"{f'batch {batch}':<10} {r['ours_step_ms']:>9.2f} {r['ours_tokens_per_s']:>9.0f} {hf} "
              f"{r['floor_step_ms']:>9.3f} {r['vs_floor']:>7.2f}x")
    overlapped = {b: r for b, r in decode.items() if r.get("async_step_ms") is not None}
    if overlapped:
        print("async scheduling (same run): " + "; ".join(
            f"batch {b}: {r['async_step_ms']:.3f} ms ({r['async_vs_floor']:.2f}x floor) vs sync "
            f"{r['ours_step_ms']:.3f} ms" for b, r in overlapped.items()))
    graphed = {b: r for b, r in decode.items() if r.get("graph_replay_ms") is not None}
    if graphed:
        print("decode step split: " + "; ".join(
            f"batch {b}: graph replay {r['graph_replay_ms']:.3f} ms ({r['graph_replay_ms'] / r['floor_step_ms']:.2f}x "
            f"floor) + host {r['host_ms']:.3f} ms" for b, r in graphed.items()))
    for b, r in decode.items():
        if r.get("async_trace"):
            print(f"decode batch {b} async steps on the device: {step_trace.format_steps(r['async_trace'])}")
        if r.get("graph_kernels"):
            print(f"decode batch {b} graph kernels per replay (us, count): {em.format_kernels(r['graph_kernels'])}; "
                  f"floor {r['floor_step_ms'] * 1e3:.0f} us")
    if "json_schema" in results:
        print(f"{'json':<10} {'plain ms':>9} {'json ms':>9} {'ratio':>7} {'+ms/tok':>8} {'steps':>6} {'closed':>7}")
        for batch, r in results["json_schema"].items():
            print(f"{f'batch {batch}':<10} {r['plain_step_ms']:>9.2f} {r['json_step_ms']:>9.2f} {r['ratio']:>6.3f}x "
                  f"{r['overhead_per_token_ms']:>8.3f} {r['steps_timed']:>6} {r['num_closed']:>7}")
    if "penalties" in results:
        print(f"{'penalties':<10} {'plain ms':>9} {'pen. ms':>9} {'ratio':>7} {'+ms/tok':>8} {'steps':>6}")
        for batch, r in results["penalties"].items():
            print(f"{f'batch {batch}':<10} {r['plain_step_ms']:>9.2f} {r['penalized_step_ms']:>9.2f} "
                  f"{r['ratio']:>6.3f}x {r['overhead_per_token_ms']:>8.3f} {r['steps_timed']:>6}")
    for name, unit in (("prefill", "tokens"), ("vision", "patches")):
        if name not in results:
            continue
        r = results[name]
        mfu = (f", MFU ours {r['ours_mfu']:.1%} / transformers {r['transformers_mfu']:.1%}" if "ours_mfu" in r
               else "")
        chunk = f", ours in chunks of {r['chunk']}" if r.get("chunk") else ""
        print(f"{name} ({r[unit]} {unit}{chunk}): ours {r[f'ours_{unit}_per_s']:.0f}/s "
              f"({r['ours_tflops']:.3g} TFLOP/s), transformers {r[f'transformers_{unit}_per_s']:.0f}/s "
              f"({r['transformers_tflops']:.3g} TFLOP/s), "
              f"{r['speedup']:.2f}x{mfu}")
    split = results.get("vision", {}).get("split")
    if split:
        towers = ", ".join(f"{impl} {ms:.2f} ms" if isinstance(ms, float) else f"{impl} n/a"
                           for impl, ms in split["tower_ms"].items())
        other = f", other {split['other_ms']:.2f}" if "other_ms" in split else ""
        unpadded = (f" ({split['mlp_width']} wide; {split['mlp_checkpoint_width_ms']:.2f} at the checkpoint's width)"
                    if "mlp_checkpoint_width_ms" in split else "")
        print(f"vision split: tower with {towers}; parts (default {split['attention_impl']}): MLPs "
              f"{split['mlp_ms']:.2f}{unpadded}, attention linears {split['attn_linears_ms']:.2f}, attention windows "
              f"{split['attention_window_ms']:.2f}, full {split['attention_full_ms']:.2f}{other} ms")
    if results.get("vision", {}).get("kernels"):
        print(f"vision kernels per forward (us, count): {em.format_kernels(results['vision']['kernels'])}")
