"""What ``unifiedserve serve``'s flags build, each checked before anything starts: the node runtime (its config, the
workers' GPU placement and MPS environment, the KV cache sized by a profile process on CUDA), the request limits, the
media policy and generation defaults, and the API's state over the started runtime. The plain server
(:mod:`unifiedserve.server.serve`) and each Ray Serve replica (:mod:`unifiedserve.ray_serve.app`) build them from the
same flags (:mod:`unifiedserve.server.serve_flags`).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from dataclasses import replace
from pathlib import Path

from unifiedserve.engine.config import EngineConfig
from unifiedserve.engine.scheduler import SchedulerConfig, server_token_budgets
from unifiedserve.runtime.config import PoolBudgets
from unifiedserve.server.limits import RequestLimits
from unifiedserve.server.media import MediaPolicy
from unifiedserve.server.serve_flags import DEFAULT_DECODE_SM_PERCENT, async_scheduling_default

log = logging.getLogger("unifiedserve")


def gpu_placement_fields(args: argparse.Namespace, device: str, num_visible_gpus: int,
                         mps_running: bool) -> dict:
    """The RuntimeConfig fields that place the workers on GPUs (``gpu``, ``process_env``), or ``{}`` on the CPU.

    Raises:
        ValueError: a GPU flag on the CPU, ``--gpus`` against ``--device cuda:N``, ``--mps on`` without a
            daemon, two GPUs (their KV would have to move between devices, which is not built), or what
            :func:`~unifiedserve.runtime.gpu_placement.plan_gpu_placement` refuses.
    """
    from unifiedserve.runtime.gpu_placement import INHERITED_MPS_SETTINGS, plan_gpu_placement

    if device == "cpu":
        given = [flag for flag, value in (("--gpus", args.gpus), ("--decode-sm-percent", args.decode_sm_percent),
                                          ("--mps", None if args.mps == "auto" else args.mps),
                                          ("--mps-priority", args.mps_priority or None)) if value is not None]
        if given:
            raise ValueError(f"{given[0]} applies to CUDA only and the server runs on the CPU")
        return {}
    if args.decode_threads:  # torch threads of a CPU decode process; a GPU's decode share is --decode-sm-percent
        raise ValueError("--decode-threads applies to the CPU only and the server runs on CUDA; the decode process's "
                         "share of the GPU is --decode-sm-percent")
    gpus = args.gpus
    if device.startswith("cuda:"):
        if gpus is not None and gpus[:1] != [int(device[5:])]:
            raise ValueError(f"--device {device} and --gpus {','.join(map(str, gpus))} disagree; give one of them")
        gpus = gpus or [int(device[5:])]
    if args.mps == "on" and not mps_running:
        raise ValueError("--mps on: no MPS daemon answers at CUDA_MPS_PIPE_DIRECTORY; start one with "
                         "launch/mps.sh start (or launch/serve-node.sh), or use --mps off")
    if args.policy == "monolithic" and args.decode_sm_percent is not None:
        raise ValueError("--decode-sm-percent: --policy monolithic has no decode process (decode runs inside "
                         "core's steps); use --policy unified or split")
    share = DEFAULT_DECODE_SM_PERCENT if args.decode_sm_percent is None else args.decode_sm_percent
    placement = plan_gpu_placement(args.policy, num_visible_gpus, gpus, share,
                                   use_mps=mps_running and args.mps != "off", mps_priority=args.mps_priority)
    physical = sorted({p.gpu for p in placement.processes.values()})
    if len(physical) > 1:
        raise ValueError(f"--gpus {','.join(map(str, physical))}: decode on its own GPU needs the KV cache moved "
                         f"between GPUs, which this server does not do yet; use one GPU (--policy split shares it "
                         f"through MPS)")
    for note in placement.notes:
        log.warning("%s", note)
    for name in INHERITED_MPS_SETTINGS:  # runtime/gpu_placement.apply_process_env drops them in every worker
        if os.environ.get(name) is not None:
            log.warning("%s=%s in the server's environment is not passed on: each process's SM share and priority "
                        "come from --policy, --decode-sm-percent and --mps-priority", name, os.environ[name])
    return {"gpu": physical[0], "process_env": {name: placement.env(name) for name in placement.processes}}


def worker_timeout(args: argparse.Namespace) -> float | None:
    """``--worker-timeout`` for the engine client: None for 0 (never).

    Raises:
        ValueError: a negative or non-finite number of seconds (NaN would switch the watch off unsaid).
    """
    if not 0 <= args.worker_timeout < math.inf:
        raise ValueError(f"--worker-timeout must be 0 (never) or a number of seconds, got {args.worker_timeout:g}")
    return args.worker_timeout or None


def check_api_key(args: argparse.Namespace) -> None:
    """Raise ValueError for an empty ``--api-key`` (or ``UNIFIEDSERVE_API_KEY``): it would serve without
    authentication, unsaid (``--api-key "$UNSET"`` in a script)."""
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key (or UNIFIEDSERVE_API_KEY) is empty; give a key, or leave both unset to serve "
                         "without one")


def resolve_model(model: str | None) -> str:
    """The checkpoint folder ``--model`` names; without one, the demo model (written on first use).

    Raises:
        ValueError: a folder without ``config.json``.
    """
    if model is None:
        from unifiedserve.model.demo import DEFAULT_DEMO_PATH, write_demo_model

        model = str(Path(DEFAULT_DEMO_PATH).expanduser())
        if not (Path(model) / "config.json").exists():
            log.info("writing the demo model to %s", model)
            write_demo_model(model)
    else:
        model = str(Path(model).expanduser())  # a quoted ~ (the shell left it), as --help shows the default
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"--model {model}: no config.json there; give a Hugging Face checkpoint folder")
    return model


def check_model(model: str) -> None:
    """Read what every worker reads of the checkpoint before it loads a weight (``config.json``, each shard's
    header, the tokenizer and preprocessor configs), so a bad checkpoint is one error line here instead of a
    traceback from each worker.

    Raises:
        ValueError: what is wrong, naming the file.
    """
    from unifiedserve.model.loader import check_checkpoint
    from unifiedserve.model.processor import load_processor

    check_checkpoint(model)
    load_processor(model)


def build_runtime(args: argparse.Namespace):
    """The node runtime the flags describe (config and worker specs; nothing started yet). Also what
    each Ray Serve replica builds.

    Raises:
        ValueError: a flag the device or the model folder refuses.
    """
    from unifiedserve.engine.device import resolve_device, resolve_dtype
    from unifiedserve.runtime.worker import FAULT_ENV, parse_fault

    parse_fault(os.environ.get(FAULT_ENV), "decode")  # a malformed testing hook: one error line, before any worker
    device = resolve_device(args.device)  # auto: the GPU when torch sees one; cuda without one: one error line
    utilization = args.gpu_memory_utilization
    if utilization is not None:
        if device == "cpu":
            raise ValueError("--gpu-memory-utilization applies to a CUDA server; on the CPU size the KV cache with "
                             "--kv-cache-gb or --num-kv-blocks")
        if args.kv_cache_gb is not None or args.num_kv_blocks is not None:
            raise ValueError("--gpu-memory-utilization sizes the KV cache itself; give it or --kv-cache-gb / "
                             "--num-kv-blocks, not both")
        from unifiedserve.engine.device import check_utilization

        try:  # before the profile: a bad share costs no process
            check_utilization(utilization)
        except ValueError as e:
            raise ValueError(f"--gpu-memory-utilization: {e}") from None
    if device == "cpu":
        placement = gpu_placement_fields(args, device, 0, False)  # GPU flags on the CPU are refused
    else:
        import torch

        from unifiedserve.runtime.gpu_placement import mps_running

        placement = gpu_placement_fields(args, device, torch.cuda.device_count(), mps_running())
        device = "cuda"  # each worker sees only its GPU (CUDA_VISIBLE_DEVICES), as cuda:0
        if utilization is None and args.kv_cache_gb is None and args.num_kv_blocks is None:
            # as vLLM: the KV cache fills the GPU's memory up to this share (sized by the profile, as with the flag;
            # a server sized at 0.4 stayed inside its share on the H200, docs/gpu.md, 2026-11-26)
            from unifiedserve.engine.device import DEFAULT_GPU_MEMORY_UTILIZATION

            utilization = DEFAULT_GPU_MEMORY_UTILIZATION  # the engine's default too (EngineConfig)
            log.info("KV cache sized by --gpu-memory-utilization %g (the CUDA default; --kv-cache-gb or "
                     "--num-kv-blocks to fix it)", utilization)
    dtype = resolve_dtype(args.dtype, device)
    async_scheduling = async_scheduling_default(args.async_scheduling, device)
    if async_scheduling and args.async_scheduling is None:
        log.info("async scheduling on (the CUDA default; --no-async-scheduling turns it off)")
    from unifiedserve.runtime.launcher import Runtime, build_config

    model = resolve_model(args.model)
    check_model(model)
    budgets = server_token_budgets(device, {k: v for k, v in (("prefill_token_budget", args.prefill_token_budget),
                                                              ("encode_token_budget", args.encode_token_budget))
                                            if v is not None}, args.tbt_slo_ms)
    try:  # the config tree checks every value once; a refusal names the flag it came from
        sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_decode_batch=args.max_decode_batch,
                                scheduling_policy=args.scheduling_policy, patches_ready_on_admit=False, **budgets)
        engine = EngineConfig(device=device, dtype=dtype, block_size=args.block_size, page_size=args.page_size,
                              enforce_eager=args.enforce_eager, async_scheduling=async_scheduling,
                              scheduler=sched,
                              enable_prefix_caching=args.prefix_caching, media_cache_gb=args.media_cache_gb)
        pools = PoolBudgets(kv_cache_gb=PoolBudgets.kv_cache_gb if args.kv_cache_gb is None else args.kv_cache_gb,
                            num_kv_blocks=args.num_kv_blocks, patch_buffer_gb=args.patch_buffer_gb,
                            visual_buffer_gb=args.visual_buffer_gb)
        if utilization is not None:  # a profile process on the GPU first (runtime/memory_plan.py)
            from unifiedserve.runtime.memory_plan import size_server_kv

            try:
                sizing = size_server_kv(model, engine, pools, utilization=utilization, gpu=placement["gpu"],
                                        process_env=placement["process_env"], vision_ahead_gb=args.vision_ahead_gb,
                                        tbt_slo_ms=args.tbt_slo_ms, budget_overrides=budgets,
                                        timeout=args.startup_timeout)
            except RuntimeError as e:  # the profile failed, died or timed out: one error line, as for a bad flag
                raise ValueError(str(e)) from None
            pools = replace(pools, num_kv_blocks=sizing.num_blocks)
        config = build_config(
            model, engine, pools, served_model_name=args.served_model_name, max_model_len=args.max_model_len,
            policy=args.policy, default_max_tokens=args.default_max_tokens, tbt_slo_ms=args.tbt_slo_ms,
            vision_threads=args.vision_threads, vision_device=args.vision_device,
            vision_ahead_gb=args.vision_ahead_gb, decode_threads=args.decode_threads,
            max_video_seconds=args.max_video_seconds, max_image_source_pixels=int(args.max_image_source_mp * 1e6),
            streaming_ingest=args.ingest == "streaming",
            budget_overrides=budgets, **placement)
    except ValueError as e:
        raise ValueError(_name_flag(str(e), args)) from None
    return Runtime(config, shm_dir=args.shm_dir)


def _name_flag(message: str, args: argparse.Namespace) -> str:
    """A config refusal (``"block_size must be ..."``) as the flag's (``"--block-size: block_size must be ..."``);
    a message that already names a flag, or a field no flag sets, stays as it is."""
    field = message.split(" ", 1)[0]
    if field.isidentifier() and hasattr(args, field):
        return f"--{field.replace('_', '-')}: {message}"
    return message


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The per-request caps from the flags (ValueError naming the flag when one is out of range)."""
    if not args.max_request_mb > 0:
        raise ValueError(f"--max-request-mb must be positive, got {args.max_request_mb}")
    inflight = args.max_inflight_request_mb
    return RequestLimits(max_pixels=args.max_pixels, max_frames=args.max_frames,
                         max_media_per_request=args.max_media_per_request, max_n=args.max_n,
                         max_request_bytes=int(args.max_request_mb * 2**20),
                         max_inflight_request_bytes=None if inflight is None else int(inflight * 2**20))


def media_policy(args: argparse.Namespace):
    """The media URL policy the flags describe."""
    return MediaPolicy(Path(args.allowed_local_media_path) if args.allowed_local_media_path else None,
                       tuple(args.allowed_media_domains), int(args.max_media_mb * 2**20))


def generation_defaults(args: argparse.Namespace, model: str | None):
    """The sampling defaults ``--generation-config`` names, for the checkpoint folder ``model``.

    Raises:
        ValueError: ``DIR`` has no generation_config.json, or a value in the file is of the wrong type or range.
    """
    from unifiedserve.model.generation import FILE, GenerationDefaults

    choice = getattr(args, "generation_config", "auto")
    if choice == "none":
        return GenerationDefaults()
    if choice != "auto":
        if not (Path(choice).expanduser() / FILE).is_file():
            raise ValueError(f"--generation-config {choice}: no {FILE} there (auto: the model's; none: no defaults)")
        return GenerationDefaults.load(choice)
    return GenerationDefaults() if model is None else GenerationDefaults.load(model)


def warn_if_images_cannot_fit(config, processor, model_config, limits: RequestLimits) -> bool:
    """Say once at start-up when an image at the default largest size (the model's ``max_pixels``, within
    ``--max-pixels``) makes more patch rows than the patch buffer holds: every such image sent without a smaller
    ``max_pixels`` would be refused."""
    rows = config.engine.num_patch_pages * config.engine.page_size
    pixels = min(processor.image_max_pixels, limits.max_pixels)
    image_rows = pixels // model_config.vision.patch_size ** 2
    if image_rows <= rows:
        return False
    log.warning("the patch buffer holds %d patch rows; an image at the default largest size (%d pixels: the "
                "model's max_pixels, within --max-pixels) makes %d, and such images will be refused unless their "
                "request lowers max_pixels: give --patch-buffer-gb more room, or lower --max-pixels", rows, pixels,
                image_rows)
    return True


def build_state(runtime, client, args: argparse.Namespace, limits: RequestLimits):
    """The API's ServerState over a started runtime (its workers ready). Also what each Ray replica builds."""
    from unifiedserve.model.config import ModelConfig
    from unifiedserve.model.processor import load_processor
    from unifiedserve.server.api import ServerState
    from unifiedserve.server.metrics import Metrics

    config = runtime.config
    processor = load_processor(config.model)
    model_config = ModelConfig.from_json(os.path.join(config.model, "config.json"))
    metrics = Metrics(config.served_model_name)
    metrics.set_pools({name: (spec.num_bytes, "cpu" if spec.cuda_handle is None else f"cuda:{config.gpu}")
                       for name, spec in config.pools.items()})
    generation = generation_defaults(args, config.model)
    if not generation.is_empty:
        log.info("sampling defaults from the generation config (a request's own values win; --generation-config "
                 "none: the OpenAI API's): %s", generation.describe())
    for key, value in generation.unsupported:
        log.warning("the generation config sets %s=%r, which this server does not implement; not applied", key, value)
    warn_if_images_cannot_fit(config, processor, model_config, limits)
    return ServerState(client, processor, metrics, media_policy(args),
                       config.served_model_name, config.max_model_len, config.default_max_tokens,
                       tuple(model_config.eos_token_ids), config.policy, args.api_key, limits, generation=generation,
                       vocab_size=model_config.text.vocab_size)
