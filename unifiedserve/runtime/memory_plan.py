"""The server's KV pool sized from ``--gpu-memory-utilization``: one profile before any worker starts.

The engine in one process (``unifiedserve.LLM``) sizes its KV cache after loading the weights, from a
profiled step (``engine/profile.py``). The server cannot wait that long: the launcher creates the shared
pools, the KV pool among them, before any worker loads the model. So the launcher profiles first:

1. It reads the memory in use on the pool GPU, as the driver counts it: other processes' and its own
   CUDA context (it owns the pools, so it holds one anyway; it keeps it through step 2, so that the
   child's figure for a context is the child's own).
2. One short-lived child process, placed on that GPU like the core worker (same ``CUDA_VISIBLE_DEVICES``
   and MPS share), builds the model with zero weights (the checkpoint is not read), and measures what the
   engine's profile measures: the weights, the patch and visual-token buffers with the attention
   workspace, the peak of a maximum encode + prefill step; and what a decode runner adds (its workspace,
   its CUDA graphs captured for the longest sequences the model allows, one eager step of
   ``max_decode_batch`` sequences); and its own CUDA context and loaded kernels (what it holds beside
   torch, less step 1's figure).
3. :func:`plan_server_kv` gives the KV pool what is left of ``total x utilization`` after: the memory in
   use before (1), the weights once (the LLM's pool is shared by core and decode, the vision tower lives
   in core), core's buffers, activations and media cache, the decode runner when it lives on this GPU
   (its own process under ``unified``/``split`` on one GPU, inside core under ``monolithic``), the vision
   process's decode-ahead bound and :data:`VISION_DECODER_GB`, and one context per worker on this GPU.

Every figure but :data:`VISION_DECODER_GB` is measured on the device at start-up, and all are logged.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from dataclasses import dataclass, replace

from unifiedserve.engine.device import KVPoolSizing, check_utilization
from unifiedserve.engine.profile import MemoryProfile
from unifiedserve.runtime.gpu_placement import apply_process_env

log = logging.getLogger("unifiedserve")

GiB = 2**30

#: What the vision process may hold on its GPU beside its decode-ahead bound (``--vision-ahead-gb``) and its
#: context: the NVDEC sessions' surface pools and the resize's intermediates. An allowance, not a measurement
#: (14 sessions x a 1080p decoded-picture buffer of about 20 NV12 surfaces of 3 MiB is 0.8 GiB).
VISION_DECODER_GB = 1.0


@dataclass(frozen=True)
class ServerKVSizing(KVPoolSizing):
    """How the server's KV pool was sized; bytes except the counts."""

    total: int
    utilization: float
    used_before: int  # in use on the GPU before the profile: other processes, the launcher's context
    weights: int  # LLM (its shared pool) + vision tower (core)
    core: int  # core's buffers, peak activations and media cache
    decode: int  # the decode runner on this GPU (0: it runs on another GPU)
    vision: int  # decode-ahead bound + VISION_DECODER_GB
    contexts: int  # a CUDA context and loaded kernels per worker on this GPU
    num_contexts: int
    bytes_per_block: int
    num_blocks: int

    utilization_name = "--gpu-memory-utilization"

    def deductions(self) -> list[tuple[str, int]]:
        return [("in use before", self.used_before), ("weights", self.weights), ("core", self.core),
                ("decode", self.decode), ("vision", self.vision), (f"{self.num_contexts} contexts", self.contexts)]


def plan_server_kv(profile: MemoryProfile, utilization: float, used_before: int, *, media_cache_bytes: int,
                   vision_ahead_bytes: int, num_contexts: int, decode_here: bool) -> ServerKVSizing:
    """The KV blocks that fit beside everything else the server's processes hold on the pool GPU (pure).

    Args:
        profile: the child's :func:`~unifiedserve.engine.profile.profile_memory` (with its decode figure).
        used_before: memory in use on the GPU before the child started (driver count).
        num_contexts: worker processes on this GPU (each holds a CUDA context and its loaded kernels).
        decode_here: whether a decode runner (its graphs, its steps) lives on this GPU.
    Raises:
        ValueError: a utilization outside (0, 1], or not one block fits (every figure named).
    """
    check_utilization(utilization)
    if decode_here and profile.decode is None:
        raise ValueError("the profile has no decode figure, but a decode runner lives on this GPU")
    context = max(0, profile.non_torch - used_before)  # the child's own: its context and kernels
    core = profile.buffers + profile.activations + media_cache_bytes
    decode = profile.decode if decode_here else 0
    vision = vision_ahead_bytes + int(VISION_DECODER_GB * GiB)
    free = (int(profile.total * utilization) - used_before - profile.weights - core - decode - vision
            - num_contexts * context)
    sizing = ServerKVSizing(profile.total, utilization, used_before, profile.weights, core, decode, vision,
                            num_contexts * context, num_contexts, profile.bytes_per_block,
                            max(free, 0) // profile.bytes_per_block)
    if sizing.num_blocks < 1:
        raise ValueError(f"--gpu-memory-utilization: no room for the KV cache: {sizing.describe()}; raise "
                         f"--gpu-memory-utilization, lower --patch-buffer-gb, --visual-buffer-gb, --media-cache-gb "
                         f"or --vision-ahead-gb, or give --kv-cache-gb")
    return sizing


def size_server_kv(model: str, engine, budgets, *, utilization: float, gpu: int, process_env: dict[str, dict[str, str]],
                   vision_ahead_gb: float, tbt_slo_ms: float | None = None,
                   budget_overrides: dict[str, int] | None = None, timeout: float = 600.0) -> ServerKVSizing:
    """Profile on physical GPU ``gpu`` and size the KV pool of a CUDA server (steps 1-3 above).

    Args:
        engine: the server's :class:`~unifiedserve.engine.config.EngineConfig` (its pool sizes not set yet).
        budgets: the :class:`~unifiedserve.runtime.config.PoolBudgets` of the patch and visual-token buffers.
        process_env: each worker's placement environment (``RuntimeConfig.process_env``); the child takes
            core's, and every worker named holds a context on this GPU.
    Raises:
        RuntimeError: the profile failed; ValueError: no KV block fits.
    """
    from unifiedserve.model.config import ModelConfig
    from unifiedserve.runtime.cuda_pools import DriverApi
    from unifiedserve.runtime.launcher import buffer_pages

    patch_pages, visual_pages = buffer_pages(ModelConfig.from_json(model), engine, budgets)
    probe = replace(engine, num_patch_pages=patch_pages, num_visual_pages=visual_pages,
                    scheduler=profile_budgets(engine.scheduler, tbt_slo_ms, budget_overrides or {}))
    api = DriverApi()  # its context lives through the profile: the child's figure must not include it
    try:
        free, total = api.mem_info(gpu)
        used_before = total - free
        profile = profile_in_child(model, probe, process_env.get("core", {}),
                                   decode_batch=engine.scheduler.max_decode_batch,
                                   graph_batch=None if engine.enforce_eager else engine.max_cuda_graph_batch,
                                   timeout=timeout)
    finally:
        api.close()
    # every worker runs on this GPU (the server refuses a second one), and a decode runner with it: the decode
    # process's, or under monolithic core's own
    sizing = plan_server_kv(profile, utilization, used_before, media_cache_bytes=engine.media_cache_bytes,
                            vision_ahead_bytes=int(vision_ahead_gb * GiB), num_contexts=len(process_env),
                            decode_here=True)
    log.info("%s", sizing.describe())
    return sizing


def profile_budgets(scheduler, tbt_slo_ms: float | None, overrides: dict[str, int]):
    """The scheduler budgets to profile at: the configured ones, or with ``tbt_slo_ms`` (core derives its
    budgets at start-up) the largest it may derive, except those given explicitly."""
    if tbt_slo_ms is None:
        return scheduler
    from unifiedserve.runtime.budget import ALPHA_RANGE, TAU_RANGE

    largest = {"prefill_token_budget": TAU_RANGE[1], "encode_token_budget": ALPHA_RANGE[1]}
    largest.update(overrides)
    return replace(scheduler, **largest)


def profile_in_child(model: str, engine, env: dict[str, str], *, decode_batch: int, graph_batch: int | None,
                     timeout: float) -> MemoryProfile:
    """Run :func:`~unifiedserve.engine.profile.profile_memory` in a fresh process with ``env`` set first (the
    core worker's GPU placement) and return its figures.

    Raises:
        RuntimeError: the child failed (its error), died, or did not finish within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_profile_main, args=(sender, model, engine, env, decode_batch, graph_batch),
                       name="unifiedserve-profile", daemon=True)
    proc.start()
    sender.close()
    try:
        if not receiver.poll(timeout):
            raise RuntimeError(f"the memory profile did not finish in {timeout:.0f} s (--startup-timeout)")
        try:
            kind, value = receiver.recv()
        except EOFError:
            proc.join(5.0)
            kind, value = "error", f"the profile process died (exit code {proc.exitcode})"
    finally:
        proc.join(10.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
        receiver.close()
    if kind != "ok":
        raise RuntimeError(f"memory profile for --gpu-memory-utilization failed: {value}")
    return value


def _profile_main(sender, model: str, engine, env: dict[str, str], decode_batch: int,
                  graph_batch: int | None) -> None:
    apply_process_env(env)  # before anything starts CUDA: the GPU and MPS share the core worker gets
    logging.basicConfig(level=os.environ.get("UNIFIEDSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s [profile] %(message)s")
    try:
        from unifiedserve.engine.llm import DTYPES
        from unifiedserve.engine.profile import profile_memory
        from unifiedserve.model.loader import zero_model

        device = "cuda:0"  # the one GPU env makes visible
        net, _ = zero_model(model, DTYPES[engine.dtype], device)
        result = ("ok", profile_memory(net, replace(engine, device=device), decode_batch, graph_batch))
    except Exception as e:  # every failure reaches the launcher as one line
        result = ("error", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    sender.send(result)
    sender.close()
