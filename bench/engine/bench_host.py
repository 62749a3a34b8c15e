#!/usr/bin/env python3
"""Host time of a decode step, the model left out: what CUDA graphs cannot remove and async scheduling must hide.

On the H200 (2026-11-26, docs/gpu.md) a 7B decode step at batch 1 took 5.71 ms, of which the graph replay was
4.78 ms: 0.92 ms of host work between replays (2.7 ms at batch 64). That work is Python and torch dispatch on
the CPU, so this machine can measure it. Two parts, each a median over repeated steps:

  - ``metadata``: the paged-KV arrays a flashinfer graph step plans from (``build_paged_batch``, the padding
    to the graph's batch size, the four int32 plan tensors and the slot/write-row tensor), for decode batches
    of B sequences holding C tokens each, block tables kept the way the runner keeps them. This is the part
    that grows with the context: a long-video request holds ~23k tokens (1,440 blocks of 16).
  - ``step``: one whole ``LLM.step()`` of B decoding requests on the CPU with the model's layers and logits
    replaced by constant tensors (no model work), torch attention backend: scheduling, the runner's inputs,
    the attention plan, sampling, stop checks and the ``LLM``'s output objects.

Same script at two commits gives the before/after of a change (it runs on older trees too)::

    python bench/engine/bench_host.py [--batches 1,8,64] [--contexts 64,4096,23000] [--out host.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_metrics as em  # noqa: E402

from unifiedserve.attention.flashinfer_backend import plan_tensors  # noqa: E402
from unifiedserve.attention.metadata import build_paged_batch, pad_decode_batch  # noqa: E402

try:  # the runner's int32 tables (since this script was written); lists before
    from unifiedserve.attention.metadata import as_block_table
except ImportError:  # pragma: no cover - older trees
    as_block_table = list


def _ints(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64)


def metadata_ms(batch: int, context: int, block_size: int = 16, repeats: int = 50) -> float:
    """Host ms of one graph decode step's paged arrays: ``batch`` sequences of ``context`` cached tokens."""
    rng = random.Random(batch * 100003 + context)
    per_seq = -(-(context + 64) // block_size)  # room for 64 more tokens, as a request's table has
    tables = [as_block_table(rng.sample(range(batch * per_seq * 2), per_seq)) for _ in range(batch)]
    seqs = [(context, 1, t) for t in tables]
    graph = 1 << (batch - 1).bit_length()  # the captured size this batch replays

    def step():
        padded = pad_decode_batch(build_paged_batch(seqs, block_size), graph)
        plan_tensors(padded)
        _ints(np.asarray([padded.slot_mapping, padded.write_rows]))  # slot map and write rows: one copy up

    return em.median_seconds(step, torch.device("cpu"), repeats) * 1e3


def step_ms(batch: int, prompt_tokens: int = 64, steps: int = 30) -> float:
    """Median host ms of ``LLM.step()`` for ``batch`` decoding requests, with no model work (see the docstring)."""
    import unifiedserve.engine.runner as runner_module
    from unifiedserve.engine import LLM, SamplingParams
    from unifiedserve.engine.config import EngineConfig
    from unifiedserve.engine.scheduler import SchedulerConfig

    blocks = batch * -(-(prompt_tokens + steps + 8) // 16) + 16
    llm = LLM(None, EngineConfig(attention="torch", num_kv_blocks=blocks, block_size=16,
                                 scheduler=SchedulerConfig(max_num_seqs=batch, max_decode_batch=batch)))
    text = llm.model_config.text
    hidden = torch.zeros(4096, text.hidden_size)
    logits = torch.zeros(4096, text.vocab_size)
    logits[:, 7] = 1.0  # greedy picks an ordinary token
    real = runner_module.run_decoder
    runner_module.run_decoder = lambda model, attn, ids, *a, **k: hidden[:ids.shape[0]]
    llm.model.compute_logits = lambda h: logits[:h.shape[0]]
    try:
        rng = random.Random(0)
        params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
        for _ in range(batch):
            llm.add_request([rng.randrange(100, 1000) for _ in range(prompt_tokens)], [], params)
        while any(not r.output_token_ids for r in llm.scheduler.requests.values()):
            llm.step()  # prefill (no model work either)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            outs = llm.step()
            times.append(time.perf_counter() - start)
            if len(outs) != batch:  # every request decodes in every timed step, or the batch is not what it says
                raise RuntimeError(f"a step of batch {batch} gave {len(outs)} tokens")
    finally:
        runner_module.run_decoder = real
    return statistics.median(times[2:]) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64", help="decode batch sizes (default 1,8,64)")
    p.add_argument("--contexts", default="64,4096,23000",
                   help="tokens each sequence holds, for the metadata part (default 64,4096,23000)")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        p.error("--batches and --contexts take comma-separated whole numbers")
    if min(batches) < 1 or min(contexts) < 1 or max(batches) > 4096:
        p.error("batch sizes must be 1..4096 and contexts >= 1")
    torch.set_num_threads(1)
    results = {"metadata_ms": {}, "step_ms": {}}
    for b in batches:
        for c in contexts:
            ms = metadata_ms(b, c)
            results["metadata_ms"][f"{b}x{c}"] = ms
            print(f"metadata  batch {b:>3} x {c:>6} tokens: {ms:8.3f} ms", flush=True)
    for b in batches:
        ms = step_ms(b)
        results["step_ms"][str(b)] = ms
        print(f"step      batch {b:>3} (no model work):   {ms:8.3f} ms", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
