"""Size the KV pool on CUDA from ``gpu_memory_utilization`` and profiled maximum-size steps (as vLLM does).

After the weights are loaded, a throw-away runner with just enough KV blocks runs one dummy step
of the largest work a step may hold: a vision encode of ``encode_token_budget`` patches and a
prefill of ``prefill_token_budget`` tokens. Its peak allocation above the runner's own tensors is
the activation figure; :func:`~unifiedserve.engine.device.size_kv_pool` does the arithmetic.

:func:`profile_memory` returns the figures themselves, and optionally those of a decode-only
process (its runner's attention workspace, its CUDA graphs and one eager decode step), for the
multi-process server, which sizes its shared pools before any worker starts
(``unifiedserve/runtime/memory_plan.py``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from unifiedserve.engine.device import KVSizing, kv_bytes_per_block, size_kv_pool

log = logging.getLogger(__name__)


def encode_grid(num_patches: int, merge: int) -> tuple[int, int, int]:
    """A near-square one-frame grid ``(1, h, w)`` of at most ``num_patches`` patches (h, w multiples of ``merge``).

    Raises:
        ValueError: fewer patches than one merge window.
    """
    if num_patches < merge * merge:
        raise ValueError(f"an encode budget of {num_patches} patches is below one {merge}x{merge} merge window")
    h = max(merge, int(math.isqrt(num_patches)) // merge * merge)
    w = max(merge, num_patches // h // merge * merge)
    return 1, h, w


@dataclass(frozen=True)
class MemoryProfile:
    """What one engine process holds on its GPU beside the KV cache, in bytes (:func:`profile_memory`)."""

    total: int  # the GPU's memory
    non_torch: int  # in use but not reserved by this process's torch: CUDA contexts, loaded kernels, others
    weights: int  # the model's parameters (everything torch held right after loading them)
    activations: int  # peak of a maximum-size encode and prefill step
    buffers: int  # the engine's patch and visual-token buffers and attention workspace
    bytes_per_block: int  # one KV block, all layers
    decode: int | None = None  # a decode-only runner: attention workspace, CUDA graphs, one eager decode step


def _sample_rows(logits: torch.Tensor, requests: int) -> None:
    """Sample every row of ``logits`` ``[B, vocab]`` the most memory-hungry way a request may ask: logit bias,
    temperature, min-p, top-k, top-p, every penalty and the most logprobs (fp32 copies, sorts and indices of
    ``[B, vocab]``), inside the caller's peak window, with the penalty counts of ``requests`` requests held (the
    process keeps them)."""
    from unifiedserve.engine.params import MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, SamplingParams
    from unifiedserve.engine.penalties import PenaltyTable
    from unifiedserve.engine.sampling import SamplerState, logprob_tensors, sample_tensor

    rows = logits.shape[0]
    table = PenaltyTable(logits.shape[-1], logits.device)
    table.reserve(max(rows, requests))
    params = [SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=i, logprobs=MAX_LOGPROBS,
                             presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.05, min_p=0.01,
                             logit_bias=[(t, 1.0) for t in range(min(MAX_LOGIT_BIAS_ENTRIES, logits.shape[-1]))])
              for i in range(rows)]
    states = [SamplerState.for_params(p, logits.device) for p in params]
    for state in states:
        state.penalty = table.open()
    tokens = sample_tensor(logits, params, states)
    logprob_tensors(logits, tokens, params)


@torch.inference_mode()
def profile_memory(model, config, decode_batch: int | None = None, decode_graph_batch: int | None = None
                   ) -> MemoryProfile:
    """Measure what ``model`` (loaded on ``config.device``, nothing else of the engine allocated yet) needs
    beside its KV cache under ``config``.

    Args:
        decode_batch: also measure a decode-only runner, as the server's decode process builds one (no patch
            or visual buffer), and one eager step of this many sequences on it.
        decode_graph_batch: capture its decode CUDA graphs up to this batch first (None: eager only), for
            sequences as long as the model's positions allow (the longest the decode process may capture).

    Raises:
        ValueError: not on CUDA.
    """
    from unifiedserve.engine.runner import ModelRunner, forward_tokens

    device = torch.device(config.device)
    if device.type != "cuda":
        raise ValueError(f"KV sizing from GPU memory needs a CUDA device, got {device}")
    text = model.config.text
    dtype = next(model.parameters()).dtype
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device)
    budget = config.scheduler.prefill_token_budget
    bs = config.block_size
    probe_blocks = -(-budget // bs)
    probe = ModelRunner(model, num_kv_blocks=probe_blocks, block_size=bs, num_patch_pages=config.num_patch_pages,
                        num_visual_pages=config.num_visual_pages, page_size=config.page_size, device=device,
                        attention=config.attention)
    probe.warmup()
    torch.cuda.synchronize(device)
    per_block = kv_bytes_per_block(text.num_hidden_layers, bs, text.num_key_value_heads, text.head_dim, dtype)
    base = torch.cuda.memory_allocated(device)
    buffers = base - weights - probe_blocks * per_block  # patch/visual buffers, attention workspace
    torch.cuda.reset_peak_memory_stats(device)
    vision = model.config.vision
    grid = encode_grid(config.scheduler.encode_token_budget, vision.spatial_merge_size)
    patch_dim = probe.patch_buffer.dim
    patches = torch.zeros((grid[1] * grid[2], patch_dim), dtype=dtype, device=device)
    visual = model.encode_vision(patches, [grid])
    del patches, visual
    ids = torch.zeros(budget, dtype=torch.int64)
    positions = torch.arange(budget).expand(3, -1)
    forward_tokens(model, probe.attn, ids, positions, [(0, budget, list(range(probe_blocks)))], None,
                   [budget - 1], torch.zeros(budget, dtype=torch.bool), probe.rope)
    # a step may also sample the first token of up to max_num_seqs requests: their logits and sampling
    first = min(config.scheduler.max_num_seqs, budget)
    _sample_rows(model.compute_logits(torch.zeros(first, text.hidden_size, dtype=dtype, device=device)),
                 config.scheduler.max_num_seqs)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - base
    log.info("profiled a step of %d prefill tokens and a %dx%d-patch encode: peak activations %.2f GiB",
             budget, grid[1], grid[2], activations / 2**30)
    del probe
    torch.cuda.empty_cache()
    decode = None
    if decode_batch is not None:
        decode = _profile_decode(model, config, probe_blocks, per_block, decode_batch, decode_graph_batch)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))  # contexts, kernels, other processes
    return MemoryProfile(total, non_torch, weights, activations, buffers, per_block, decode)


def _profile_decode(model, config, probe_blocks: int, per_block: int, batch: int, graph_batch: int | None) -> int:
    """Bytes a decode-only runner adds beside its KV blocks: workspace, graphs (reserved, so their pools
    count whole), and the peak of one eager step of ``batch`` one-token sequences."""
    from unifiedserve.attention import TorchPagedAttention
    from unifiedserve.engine.device import graph_batch_sizes
    from unifiedserve.engine.runner import ModelRunner, forward_tokens
    from unifiedserve.engine.runner_startup import TORCH_GRAPH_MAX_SEQ_LEN

    device = torch.device(config.device)
    text = model.config.text
    before = torch.cuda.memory_reserved(device)
    probe = ModelRunner(model, num_kv_blocks=probe_blocks, block_size=config.block_size, num_patch_pages=0,
                        num_visual_pages=0, page_size=config.page_size, device=device, attention=config.attention)
    probe.attn.warmup()
    if isinstance(probe.attn, TorchPagedAttention):
        log.warning("the torch attention backend's eager decode steps gather every sequence's keys, so their memory "
                    "grows with sequence length; the profile measures one-token sequences (steps above the CUDA-graph "
                    "batch, or past %d tokens, may need more than --gpu-memory-utilization leaves)",
                    TORCH_GRAPH_MAX_SEQ_LEN)
    if graph_batch is not None and probe.attn.supports_cuda_graph:
        longest = text.max_position_embeddings  # the decode process's graphs serve up to its KV capacity
        if isinstance(probe.attn, TorchPagedAttention):
            longest = min(longest, TORCH_GRAPH_MAX_SEQ_LEN)
        # every variant at every size: the most the serving runner's tuned graphs may hold
        probe.capture_decode_graphs(graph_batch_sizes(graph_batch), max_seq_len=longest, variants="all")
    torch.cuda.synchronize(device)
    held = max(0, torch.cuda.memory_reserved(device) - before - probe_blocks * per_block)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(batch, dtype=torch.int64)
    positions = torch.zeros(3, batch, dtype=torch.int64)
    seqs = [(0, 1, [i % probe_blocks]) for i in range(batch)]  # dummy rows: overlapping writes are harmless
    logits = forward_tokens(model, probe.attn, ids, positions, seqs, None, list(range(batch)),
                            torch.zeros(batch, dtype=torch.bool), probe.rope)
    _sample_rows(logits, max(batch, config.scheduler.max_num_seqs))
    del logits
    torch.cuda.synchronize(device)
    step = torch.cuda.max_memory_allocated(device) - base
    log.info("profiled a decode-only runner: %.2f GiB beside its KV (workspace and CUDA graphs %.2f, a %d-sequence "
             "eager step %.2f)", (held + step) / 2**30, held / 2**30, batch, step / 2**30)
    del probe
    torch.cuda.empty_cache()
    return held + step


def profile_kv_sizing(model, config) -> KVSizing:
    """Measure and size the KV pool for ``model`` (loaded on ``config.device``) under ``config``.

    Args:
        model: the loaded model, nothing else of the engine allocated yet.
        config: the :class:`~unifiedserve.engine.llm.EngineConfig` (CUDA device, utilization set).

    Returns:
        The sizing, every figure logged.

    Raises:
        ValueError: not on CUDA, or not even one KV block fits.
    """
    p = profile_memory(model, config)
    # the media cache (encoded visual tokens, on this device) fills up to its bound as media arrive
    media_cache = int(config.media_cache_gb * 2**30)
    sizing = size_kv_pool(p.total, config.gpu_memory_utilization, p.weights, p.activations,
                          p.non_torch + p.buffers + media_cache, p.bytes_per_block)
    log.info("%s", sizing.describe())
    return sizing
