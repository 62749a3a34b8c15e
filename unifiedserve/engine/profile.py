"""Size the KV pool on CUDA from ``gpu_memory_utilization`` and a profiled maximum-size step (as vLLM does).

After the weights are loaded, a throw-away runner with just enough KV blocks runs one dummy step
of the largest work a step may hold: a vision encode of ``encode_token_budget`` patches and a
prefill of ``prefill_token_budget`` tokens. Its peak allocation above the runner's own tensors is
the activation figure; :func:`~unifiedserve.engine.device.size_kv_pool` does the arithmetic.
"""

from __future__ import annotations

import logging
import math

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


@torch.inference_mode()
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
    from unifiedserve.engine.runner import ModelRunner, forward_tokens

    device = torch.device(config.device)
    if device.type != "cuda":
        raise ValueError(f"KV sizing from GPU memory needs a CUDA device, got {device}")
    text = model.config.text
    dtype = next(model.parameters()).dtype
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))  # CUDA context, other processes
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
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - base
    del probe
    torch.cuda.empty_cache()
    # the media cache (encoded visual tokens, on this device) fills up to its bound as media arrive
    media_cache = int(config.media_cache_gb * 2**30)
    sizing = size_kv_pool(total, config.gpu_memory_utilization, weights, activations,
                          non_torch + buffers + media_cache, per_block)
    log.info("%s; profiled a step of %d prefill tokens and a %dx%d-patch encode", sizing.describe(), budget,
             grid[1], grid[2])
    return sizing
