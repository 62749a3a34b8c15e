"""The core process: vision encode and chunked prefill, co-scheduled under budgets (Algorithm 3).

Each iteration: the scheduler admits requests whose patch pages fit (their pages go to vision in
``WritePatches``), schedules encode items of media already written (budget alpha) and prefill
chunks (budget tau), and the runner executes them. A request whose prompt is done samples its
first token here; it then goes to the decode process (``Handoff``: block table, first token,
M-RoPE delta, sampler state) and keeps its KV blocks until decode sends ``ReleaseBlocks``.

Under ``--policy monolithic`` there is no decode process: decode tokens join core's iterations
next to encode and prefill work (vLLM/SGLang chunked prefill), so an encoder step delays them.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from unifiedserve.engine.inputs import MediaGrid, make_request
from unifiedserve.engine.llm import DTYPES
from unifiedserve.engine.runner import ModelRunner
from unifiedserve.engine.core import EngineCore, SequenceState
from unifiedserve.engine.sampling import SamplerState
from unifiedserve.engine.structured import grammar_for
from unifiedserve.engine.scheduler import Scheduler
from unifiedserve.memory.block_manager import BlockManager
from unifiedserve.memory.pages import PageAllocator
from unifiedserve.model.loader import load_model
from unifiedserve.runtime import protocol
from unifiedserve.runtime.shm import open_pool
from unifiedserve.runtime.worker import (IterationCounters, Worker, device_memory_gauges, memory_info, pool_barrier,
                                         token_message, weight_gauges)

log = logging.getLogger("unifiedserve")


class CoreWorker(Worker):
    name = "core"
    inbox_type = protocol.ToCore

    def setup(self) -> dict[str, str]:
        cfg, eng = self.config, self.config.engine
        # the LLM's weights go into the shared pool, where decode reads them too (one copy)
        weights = open_pool(cfg.pools["weights"]) if "weights" in cfg.pools else None
        self.model, self.model_config = load_model(cfg.model, DTYPES[eng.dtype], eng.device, llm_storage=weights)
        self.model.eval()
        if weights is not None and "decode" in cfg.processes:  # decode waits for this before it runs the model
            if torch.device(eng.device).type == "cuda":
                torch.cuda.synchronize(eng.device)  # the copies into the pool are done before decode reads it
            self.send("decode", protocol.WeightsLoaded())
        self._weight_gauges = weight_gauges(self.model, weights)
        kv, patch = open_pool(cfg.pools["kv"]), open_pool(cfg.pools["patch"])
        self._pages_barrier = pool_barrier(patch.device)  # before vision may write pages this process read
        self.runner = ModelRunner(self.model, num_kv_blocks=eng.num_kv_blocks, block_size=eng.block_size,
                                  num_patch_pages=eng.num_patch_pages, num_visual_pages=eng.num_visual_pages,
                                  page_size=eng.page_size, device=eng.device, kv_storage=kv, patch_storage=patch,
                                  attention=eng.attention, media_cache_bytes=eng.media_cache_bytes)
        # kernels that compile on first use (flashinfer on CUDA: tens of seconds each) compile now, before
        # any request and before the budget profile; CUDA graphs only where core decodes (monolithic)
        self.runner.warmup(eng.max_cuda_graph_batch if cfg.policy == "monolithic" and not eng.enforce_eager else None)
        sched_cfg = eng.scheduler
        info = {}
        if cfg.tbt_slo_ms is not None:
            from unifiedserve.runtime.budget import derive_budgets

            sched_cfg, how = derive_budgets(self.runner, cfg, sched_cfg)
            info["budget_profile"] = how
        blocks = BlockManager(eng.num_kv_blocks, eng.block_size, eng.enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, blocks,
                                   PageAllocator(eng.num_patch_pages, eng.page_size),
                                   PageAllocator(eng.num_visual_pages, eng.page_size), self.runner.media_cache)
        self.core = EngineCore(self.scheduler, self.runner, eng.async_scheduling)  # decode steps: monolithic
        self.stages: dict[str, protocol.StageTimes] = {}  # per request while core holds it
        self.decode_here = cfg.policy == "monolithic"
        self._stalled = False  # the last schedule() found nothing to run; wait for a message
        self.iterations = IterationCounters("core")
        self._threads_all = torch.get_num_threads()  # unified on CPU: fewer while decode or vision is busy
        self._threads_shared = cfg.core_threads_shared or self._threads_all
        info.update({
            "device": eng.device, "dtype": eng.dtype, "nice": str(os.nice(0)),
            "torch_threads": (f"{self._threads_all} ({self._threads_shared} while decode or vision is busy)"
                              if self._threads_shared != self._threads_all else str(self._threads_all)),
            "prefill_token_budget": str(sched_cfg.prefill_token_budget),
            "encode_token_budget": str(sched_cfg.encode_token_budget),
            "kv_cache": f"{eng.num_kv_blocks} blocks x {eng.block_size} tokens",
            "visual_buffer": f"{eng.num_visual_pages} pages x {eng.page_size} rows",
            "prefix_caching": "on" if eng.enable_prefix_caching else "off",
            "media_cache": f"{eng.media_cache_gb:g} GiB" if self.runner.media_cache is not None else "off",
            **memory_info(self._weight_gauges, eng.device),
        })
        return info

    def has_work(self) -> bool:
        return self.scheduler.has_work and not self._stalled

    def stats(self) -> dict[str, float]:
        s = self.scheduler
        return {"kv_blocks_used": s.blocks.num_used_blocks, "kv_blocks_total": s.blocks.num_blocks,
                "patch_pages_used": s.patch_pages.num_used_pages, "patch_pages_total": s.patch_pages.num_pages,
                "visual_pages_used": s.visual_pages.num_used_pages, "visual_pages_total": s.visual_pages.num_pages,
                "num_waiting": s.num_waiting, "num_prefilling": len(s.running) - (s.num_waiting - len(s.waiting)),
                "prefix_cache_queried_tokens": s.prefix_queried_tokens, "prefix_cache_hit_tokens": s.prefix_hit_tokens,
                "media_cache_queried_tokens": s.media_queried_tokens, "media_cache_hit_tokens": s.media_hit_tokens,
                "media_cache_bytes": self.runner.media_cache.num_bytes if self.runner.media_cache is not None else 0,
                **self.iterations.gauges(), **self._weight_gauges, **device_memory_gauges(self.config.engine.device)}

    # -- messages ------------------------------------------------------------------------------------
    def handle(self, message) -> None:
        self._stalled = False
        if isinstance(message, protocol.AddRequest):
            self._add(message)
        elif isinstance(message, protocol.MediaReady):
            rid = message.request_id
            req = self.scheduler.requests.get(rid)
            was_whole = req is not None and message.media_index in req.ready_media
            if self.scheduler.mark_media_ready(rid, message.media_index, message.num_rows):
                stages = self.stages[rid]
                if message.decode_start and not (0 < stages.video_decode_start <= message.decode_start):
                    stages.video_decode_start = message.decode_start
                if not stages.first_part_ready:  # the request's first rows: where streaming's head start goes
                    stages.first_part_ready = time.time()
                    stages.first_part_decoded, stages.first_part_written = message.decoded_at, message.written_at
                if not was_whole and message.media_index in req.ready_media:  # now whole: its decode time
                    stages.video_decode_s += message.video_decode_s
                if len(req.ready_media) == req.num_media:
                    stages.media_ready = time.time()
        elif isinstance(message, protocol.AbortRequest):
            rid = message.request_id
            if rid in self.scheduler.requests:
                self._finish(rid, "abort")
                self.send("vision", protocol.CancelMedia(rid))
            elif not self.decode_here and rid in self.scheduler.handed_off:
                self.send("decode", message)  # decode replies with ReleaseBlocks
        elif isinstance(message, protocol.ReleaseBlocks):
            outputs = message.output_token_ids
            for i, rid in enumerate(message.request_ids):
                self.scheduler.release(rid, outputs[i] if i < len(outputs) else ())

    def _add(self, msg: protocol.AddRequest) -> None:
        grids = [MediaGrid(p.kind, tuple(p.grid_thw), p.second_per_grid_t) for p in msg.media]
        try:
            request = make_request(msg.request_id, msg.prompt_token_ids, msg.params, grids, self.model_config)
            grammar = grammar_for(msg.params, self.config.model, msg.stop_token_ids)  # response_format
            request.media_keys = list(msg.media_keys) if len(msg.media_keys) == len(grids) else []
            seq = SequenceState(msg.params, SamplerState.for_params(msg.params, self.runner.device, grammar),
                                frozenset(msg.stop_token_ids), request.output_token_ids)
            self.core.add(request, grids, seq)  # the scheduler checks it before anything changes
        except ValueError as e:
            self.send("vision", protocol.CancelMedia(msg.request_id))
            self.send("api", protocol.RequestFailed(msg.request_id, str(e), 400))
            return
        self.stages[msg.request_id] = protocol.StageTimes(added=time.time())

    # -- one iteration ----------------------------------------------------------------------------------
    def step(self) -> None:
        now = time.time()
        out, sampled = self.core.step(before_execute=self._hand_out_pages)
        if out.is_empty:
            if sampled:  # an async decode step read back before a step that ran nothing: what it finishes frees
                self._outputs(sampled)  # seats and blocks a waiting request may take at the next step
            else:
                self._stalled = True  # waiting on media or on KV blocks: nothing changes until a message
            return
        end = time.time()
        encode_s = self.runner.last_encode_s
        encode_end = now + encode_s
        self.iterations.record(end - now, encode=out.patch_read.num_tokens if out.patch_read is not None else 0,
                               prefill=sum(c.num_tokens for c in out.prefill), decode=len(out.decode),
                               encode_s=encode_s)
        for work in out.encode:
            st = self.stages[work.request_id]
            st.encode_start = st.encode_start or now
            st.encode_end = encode_end
        for chunk in out.prefill:
            st = self.stages[chunk.request_id]
            st.prefill_start = st.prefill_start or encode_end
            st.prefill_end = end
        if sampled:
            self._outputs(sampled)

    def _hand_out_pages(self, out) -> None:
        """Before the step runs: admitted requests' patch pages to vision, and the thread count."""
        now = time.time()
        for rid in out.admitted:
            self.stages[rid].admitted = now
        # rows of patch_write are the admitted requests with patches to write, in order; a request whose
        # media the caches hold entirely has none: vision forgets it
        index, b = out.patch_write, 0
        if index is not None and any(self.scheduler.requests[rid].num_patch_rows_needed for rid in out.admitted):
            self._pages_barrier()  # the pages may have been read by an encode step still running (CUDA)
        for rid in out.admitted:
            req = self.scheduler.requests[rid]
            if req.num_patch_rows_needed:
                pages = index.pv_page_indices[index.pv_page_indptr[b]:index.pv_page_indptr[b + 1]]
                self.send("vision", protocol.WritePatches(rid, list(pages), out.skip_media.get(rid, [])))
                b += 1
            elif req.num_media:
                self.send("vision", protocol.CancelMedia(rid))
                self.stages[rid].media_ready = now
        # leave decode its cores while it has requests, and vision while it decodes a running request's
        # video: on 2 cores, streaming ingest with core at 2 threads took 15.6-17.3 s to the first
        # token of a 3-minute video, at 1 thread while vision decodes 14.4-15.0 s (docs/benchmarks.md)
        busy = self.scheduler.handed_off or self.scheduler.ingesting
        threads = self._threads_shared if busy else self._threads_all
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def _outputs(self, sampled) -> None:
        outputs, handoffs, failed = [], [], []
        for rid, r in sampled:
            message = token_message(rid, r, self.stages[rid] if r.index == 0 else None)
            # a failure (no token) reaches api after the step's tokens, so after the request's earlier ones
            (failed if isinstance(message, protocol.RequestFailed) else outputs).append(message)
            if r.finish_reason is not None:
                self._finish(rid, r.finish_reason)
                continue
            if self.decode_here:
                continue
            req, seq, table, delta = self.core.hand_off(rid)
            handoffs.append(protocol.Handoff(rid, table, req.prompt_len, delta, r.token_id, seq.params,
                                             sorted(seq.stop_ids), seq.sampler.to_bytes(),
                                             sorted(set(req.prompt_token_ids)) if seq.params.penalizes_prompt else []))
            self.stages.pop(rid)
        self.send("api", protocol.TokenOutputs(outputs))  # before the hand-off: token 0 reaches api first
        for message in failed:
            self.send("api", message)
        for h in handoffs:
            self.send("decode", h)

    def _finish(self, rid: str, reason: str) -> None:
        self.core.finish(rid, reason)
        self.stages.pop(rid, None)
