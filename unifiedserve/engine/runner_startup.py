"""The model runner's start-up (:class:`RunnerStartup`, a base of :class:`unifiedserve.engine.runner.ModelRunner`):
attention kernels compiled or loaded, the decode GEMMs and the decode graphs' attention timed on this model and
device, and the decode CUDA graphs captured, all before the first request."""

from __future__ import annotations

import logging
import time

import torch

from unifiedserve import ops
from unifiedserve.attention import TorchPagedAttention

__all__ = ["TORCH_GRAPH_MAX_SEQ_LEN", "RunnerStartup"]

log = logging.getLogger("unifiedserve.engine.runner")  # the runner's log, as before the split

#: Longest sequence a torch-SDPA CUDA graph serves: its decode gathers ``max_seq_len`` keys per
#: sequence whatever the real lengths, so longer steps run eagerly instead.
TORCH_GRAPH_MAX_SEQ_LEN = 4096


class RunnerStartup:
    """Start-up steps of a :class:`~unifiedserve.engine.runner.ModelRunner` (which owns every attribute used here:
    ``model``, ``attn``, ``kv_cache``, ``rope``, ``device``, ``dtype``, ``patch_buffer``, ``block_size``, ``graphs``,
    ``decode_attention_tuning`` and the live requests' ``_tensors``)."""

    def warmup(self, max_cuda_graph_batch: int | None = None) -> None:
        """Compile/load the attention kernels (flashinfer JITs on first use) before any request: the LLM's
        and, where this runner encodes (it has a patch buffer), the vision tower's fused attention; on CUDA,
        capture decode graphs for batches up to ``max_cuda_graph_batch`` (None: decode runs eagerly)."""
        self.attn.warmup()
        if self.device.type != "cuda":
            return
        if self.patch_buffer is not None:
            from unifiedserve.attention.warmup import warm_vision

            warm_vision(self.model.config.vision, self.device, self.dtype)
        if max_cuda_graph_batch is None:
            return
        from unifiedserve.engine.device import graph_batch_sizes

        sizes = graph_batch_sizes(max_cuda_graph_batch)
        self.tune_decode_gemms(sizes)  # before the capture: the graphs record the kernels it chose
        if self.attn.supports_cuda_graph:
            self.capture_decode_graphs(sizes)
        else:
            log.info("decode runs eagerly: %s cannot capture CUDA graphs", type(self.attn).__name__)

    def tune_decode_gemms(self, batch_sizes) -> list:
        """Time the decoder's GEMMs at the decode batch sizes up to 16: cuBLAS against the skinny kernel
        (:mod:`unifiedserve.ops.skinny`), on this model's weights; later steps take whichever was faster per
        shape. CUDA with bfloat16/float16 weights and Triton only (:func:`~unifiedserve.ops.skinny.tune` skips the
        rest). Returns the measurements."""
        from unifiedserve.ops import skinny

        if self.device.type != "cuda":
            return []
        with torch.inference_mode():
            results = skinny.tune(self.model.language_model.skinny_groups(), batch_sizes,
                                  silu_and_mul=ops.silu_and_mul)
        if results:
            log.info("decode GEMMs tuned in %.1f s: %s", skinny.tune_seconds(), skinny.summary(results))
        return results

    def capture_decode_graphs(self, batch_sizes, max_seq_len: int | None = None, variants: str = "tune") -> None:
        """Capture decode steps as CUDA graphs at these batch sizes (start-up only: no request may be running).

        Args:
            batch_sizes: decode batch sizes; a step of ``n`` sequences replays the smallest size >= n.
            max_seq_len: longest sequence a graph step serves (default: the KV cache's capacity,
                capped by the model's ``max_position_embeddings`` and, for the torch backend, by
                :data:`TORCH_GRAPH_MAX_SEQ_LEN`); longer steps run eagerly.
            variants: the attention backend's graph variants per size (flashinfer: split-KV, and split-free for
                short sequences): ``tune`` times them first and captures the ones that win, ``all`` captures every
                one (the memory profile).

        Raises:
            ValueError: not on CUDA, requests are live, or the backend cannot capture.
        """
        from unifiedserve.engine.cuda_graph import DecodeGraphs

        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this runner is on {self.device}")
        if self._tensors:
            raise ValueError("capture decode graphs at start-up, before any request is added")
        if variants not in ("tune", "all"):
            raise ValueError(f"variants must be 'tune' or 'all', got {variants!r}")
        if max_seq_len is None:
            max_seq_len = min(self.kv_cache.num_blocks * self.block_size,
                              self.model.config.text.max_position_embeddings)
            if isinstance(self.attn, TorchPagedAttention):
                max_seq_len = min(max_seq_len, TORCH_GRAPH_MAX_SEQ_LEN)
        start = time.perf_counter()
        graphs = DecodeGraphs(self.model, self.attn, self.rope, batch_sizes, max_seq_len)
        if variants == "tune":
            self.tune_decode_attention()
        else:
            self.attn.offer_every_graph_variant()
        graphs.capture()
        self.graphs = graphs
        log.info("captured decode CUDA graphs for batch sizes %s (sequences up to %d tokens; variants %s) in %.1f s",
                 list(self.graphs.batch_sizes), max_seq_len, graphs.variants(), time.perf_counter() - start)

    def tune_decode_attention(self) -> list:
        """Time the attention backend's decode-graph variants (flashinfer: split-KV against split-free, per batch
        size and sequence length, :mod:`unifiedserve.attention.split_kv`) and keep the faster per length. Between
        the backend's ``init_cuda_graph`` and the capture; returns the measurements (kept in
        ``decode_attention_tuning``)."""
        results = self.attn.tune_graph_variants(self.model.config.text.num_hidden_layers)
        self.decode_attention_tuning = results
        if results:
            from unifiedserve.attention import split_kv

            log.info("decode attention graphs tuned in %.1f s: %s", split_kv.tune_seconds(), split_kv.summary(results))
        return results
