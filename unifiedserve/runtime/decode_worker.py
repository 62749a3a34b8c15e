"""The decode process: continuous batching over handed-off requests, on the shared KV cache.

A ``Handoff`` brings a prefilled request: its KV block table (already sized for prompt +
max_tokens, so a decode step never waits on another process for blocks), its first token, its
M-RoPE delta and its sampler state. The process drives the same :class:`EngineCore` step as core
and the in-process ``LLM``, over a decode-only scheduler (``Scheduler.decode_only``: adopted
requests, decode rows only, ``max_decode_batch`` at a time, the rest waiting in order) and a
runner without embedding buffers. Every step streams the tokens to api and tells core which
requests finished (``ReleaseBlocks``): the blocks are core's, decode never frees them.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from unifiedserve.engine.llm import DTYPES
from unifiedserve.engine.core import EngineCore, SequenceState
from unifiedserve.engine.runner import ModelRunner
from unifiedserve.engine.sampling import SamplerState
from unifiedserve.engine.scheduler import Scheduler
from unifiedserve.engine.structured import grammar_for
from unifiedserve.model.loader import load_model
from unifiedserve.runtime import protocol
from unifiedserve.runtime.shm import open_pool
from unifiedserve.runtime.worker import (IterationCounters, Worker, device_memory_gauges, memory_info, token_message,
                                         weight_gauges)

log = logging.getLogger("unifiedserve")


class BlockReleases:
    """Which finished requests' blocks may go back to core now (``ReleaseBlocks``).

    With async scheduling a request can end while a launched step still computes a row of it, whose K/V
    write lands in one of its blocks. Core would hand the block to another request and write into it on its
    own stream, unordered with this process's, so the release waits until no pending step of this engine
    core holds a row of the request (the next read-back has waited for that step's event).
    """

    def __init__(self, core: EngineCore):
        self.core = core
        self.held: list[str] = []

    def ready(self, finished: list[str]) -> list[str]:
        """``finished`` plus those held before, less the ones a pending step still writes (held for later)."""
        candidates, self.held = self.held + finished, []
        now = []
        for rid in candidates:
            (self.held if self.core.writes_pending(rid) else now).append(rid)
        return now


class DecodeWorker(Worker):
    name = "decode"
    inbox_type = protocol.ToDecode

    def setup(self) -> dict[str, str]:
        cfg, eng = self.config, self.config.engine
        # core fills the shared weights pool; decode only maps it. Its start-up runs the model (the decode GEMMs'
        # tune times and checks kernels on these weights, the CUDA graphs' warm-up): only once core says they are
        # in. (Before, decode tuned on a pool core was still writing: on the H100 its output checks compared
        # against all-zero and half-written layers and refused configs that were right.)
        weights = open_pool(cfg.pools["weights"]) if "weights" in cfg.pools else None
        # decode never encodes: the vision tower is left unallocated
        self.model, _ = load_model(cfg.model, DTYPES[eng.dtype], eng.device, llm_storage=weights,
                                   fill_llm=weights is None, load_vision=False)
        self.model.eval()
        self._weight_gauges = weight_gauges(self.model, weights)
        if weights is not None:  # building the model above read none of them
            self.wait_for(protocol.WeightsLoaded, "core to load the weights")
        runner = ModelRunner(self.model, num_kv_blocks=eng.num_kv_blocks, block_size=eng.block_size,
                             num_patch_pages=0, num_visual_pages=0, page_size=eng.page_size, device=eng.device,
                             kv_storage=open_pool(cfg.pools["kv"]), attention=eng.attention)
        runner.warmup(None if eng.enforce_eager else eng.max_cuda_graph_batch)  # CUDA graphs: decode's own
        self.scheduler = Scheduler.decode_only(eng.scheduler)
        self.core = EngineCore(self.scheduler, runner, eng.async_scheduling)
        self._outputs: dict[str, list[int]] = {}  # finished, blocks not yet released -> its outputs
        self.releases = BlockReleases(self.core)
        self.iterations = IterationCounters("decode")
        return {"device": eng.device, "torch_threads": str(torch.get_num_threads()), "nice": str(os.nice(0)),
                "max_decode_batch": str(self.scheduler.config.max_decode_batch),
                **memory_info(self._weight_gauges, eng.device)}

    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.releases.held)  # a step reads the pending one back

    def stats(self) -> dict[str, float]:
        return {"num_decoding": len(self.scheduler.running),  # in the batch, and waiting for a place in it
                **self.iterations.gauges(), **self._weight_gauges, **device_memory_gauges(self.config.engine.device)}

    def handle(self, message) -> None:
        if isinstance(message, protocol.Handoff):
            h = message
            # a response_format grammar is rebuilt here from the params and the first token (core's)
            grammar = grammar_for(h.params, self.config.model, h.stop_token_ids, [h.first_token])
            sampler = SamplerState.from_bytes(h.sampler_state, self.config.engine.device, grammar)
            seq = SequenceState(h.params, sampler, frozenset(h.stop_token_ids), [h.first_token])
            self.core.adopt(h.request_id, seq, h.prompt_len, h.mrope_delta, h.block_table, h.penalty_prompt_ids)
        elif isinstance(message, protocol.AbortRequest):
            if message.request_id not in self.scheduler.requests:
                return  # already finished: its blocks were released then
            self._finish(message.request_id, "abort")
            self._release([message.request_id])

    def step(self) -> None:
        start = time.perf_counter()
        out, sampled = self.core.step()
        if not out.is_empty:
            self.iterations.record(time.perf_counter() - start, decode=len(out.decode))
        outputs, finished, failed = [], [], []
        for rid, r in sampled:
            message = token_message(rid, r)
            # a failure (no token) reaches api after the step's tokens, so after the request's earlier ones
            (failed if isinstance(message, protocol.RequestFailed) else outputs).append(message)
            if r.finish_reason is not None:
                self._finish(rid, r.finish_reason)
                finished.append(rid)
        if outputs:
            self.send("api", protocol.TokenOutputs(outputs))
        for message in failed:
            self.send("api", message)
        self._release(finished)

    def _finish(self, request_id: str, reason: str) -> None:
        """End a request here; its outputs go back with its blocks (core caches the blocks they filled)."""
        seq = self.core.seqs.get(request_id)
        self._outputs[request_id] = list(seq.output_token_ids) if seq is not None else []
        self.core.finish(request_id, reason)

    def _release(self, finished: list[str]) -> None:
        ready = self.releases.ready(finished)
        if ready:
            self.send("core", protocol.ReleaseBlocks(ready, [self._outputs.pop(r, []) for r in ready]))
