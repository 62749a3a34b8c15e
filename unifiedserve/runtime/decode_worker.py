"""The decode process: continuous batching over handed-off requests, on the shared KV cache.

A ``Handoff`` brings a prefilled request: its KV block table (already sized for prompt +
max_tokens, so a decode step never waits on another process for blocks), its first token, its
M-RoPE delta and its sampler state. Every step decodes one token for each request in the batch,
streams the tokens to api, and tells core which requests finished (``ReleaseBlocks``).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass

import torch

from unifiedserve.attention import KVCache, get_attention_backend
from unifiedserve.engine.llm import DTYPES
from unifiedserve.engine.core import SequenceState, process_logits
from unifiedserve.engine.runner import decode_row, forward_tokens
from unifiedserve.engine.sampling import SamplerState
from unifiedserve.engine.structured import grammar_for
from unifiedserve.model.loader import load_model
from unifiedserve.runtime import protocol
from unifiedserve.runtime.shm import open_pool
from unifiedserve.runtime.worker import Worker

log = logging.getLogger("unifiedserve")


@dataclass
class _Seq:
    handoff: protocol.Handoff
    seq: SequenceState  # output tokens so far: the first came from core


class DecodeWorker(Worker):
    name = "decode"
    inbox_type = protocol.ToDecode

    def setup(self) -> dict[str, str]:
        cfg = self.config
        # core fills the shared weights pool; decode only maps it (it runs nothing before core's first hand-off)
        weights = open_pool(cfg.pools["weights"]) if "weights" in cfg.pools else None
        self.model, model_config = load_model(cfg.model, DTYPES[cfg.dtype], cfg.device, llm_storage=weights,
                                              fill_llm=weights is None)
        self.model.eval()
        text = model_config.text
        kv = open_pool(cfg.pools["kv"])
        cache = KVCache(text.num_hidden_layers, cfg.num_kv_blocks, cfg.block_size, text.num_key_value_heads,
                        text.head_dim, storage=kv)
        self.attn = get_attention_backend(cfg.device)(cache, text.num_attention_heads, text.num_key_value_heads,
                                                      text.head_dim)
        self.batch: dict[str, _Seq] = {}
        self.pending: deque[protocol.Handoff] = deque()  # beyond max_decode_batch
        return {"device": cfg.device, "torch_threads": str(torch.get_num_threads()), "nice": str(os.nice(0)),
                "max_decode_batch": str(cfg.max_decode_batch)}

    def has_work(self) -> bool:
        return bool(self.batch)

    def stats(self) -> dict[str, float]:
        return {"num_decoding": len(self.batch) + len(self.pending)}

    def handle(self, message) -> None:
        if isinstance(message, protocol.Handoff):
            self.pending.append(message)
            self._fill()
        elif isinstance(message, protocol.AbortRequest):
            rid = message.request_id
            if self.batch.pop(rid, None) is not None:
                self._fill()
            else:
                before = len(self.pending)
                self.pending = deque(h for h in self.pending if h.request_id != rid)
                if len(self.pending) == before:
                    return  # already finished: its blocks were released then
            self.send("core", protocol.ReleaseBlocks([rid]))

    def _fill(self) -> None:
        while self.pending and len(self.batch) < self.config.max_decode_batch:
            h = self.pending.popleft()
            # a response_format grammar is rebuilt here from the params and the first token (core's)
            grammar = grammar_for(h.params, self.config.model, h.stop_token_ids, [h.first_token])
            sampler = SamplerState.from_bytes(h.sampler_state, self.config.device, grammar)
            self.batch[h.request_id] = _Seq(h, SequenceState(h.params, sampler, frozenset(h.stop_token_ids),
                                                             [h.first_token]))

    @torch.inference_mode()
    def step(self) -> None:
        batch = list(self.batch.values())
        rows = [decode_row(b.handoff.prompt_len + len(b.seq.output_token_ids) - 1, b.seq.output_token_ids[-1],
                           b.handoff.mrope_delta, b.handoff.block_table) for b in batch]
        ids, positions, seqs = (list(column) for column in zip(*rows))
        logits = forward_tokens(self.model, self.attn, torch.cat(ids), torch.cat(positions, dim=1), seqs, None,
                                list(range(len(batch))),
                                visual_mask=torch.zeros(len(batch), dtype=torch.bool))  # generated tokens are text
        outputs, finished = [], []
        for b, r in zip(batch, process_logits(logits, [b.seq for b in batch])):
            rid = b.handoff.request_id
            outputs.append(protocol.TokenOutput(rid, r.index, r.token_id, r.finish_reason, None,
                                                *(r.logprobs if r.logprobs is not None else (None, None))))
            if r.finish_reason is not None:
                finished.append(rid)
        self.send("api", protocol.TokenOutputs(outputs))
        if finished:
            for rid in finished:
                del self.batch[rid]
            self.send("core", protocol.ReleaseBlocks(finished))
            self._fill()
