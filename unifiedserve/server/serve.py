"""``unifiedserve serve``: start the workers and pools, then the HTTP API; shut all of it down cleanly.

Exit status: 0 after SIGINT/SIGTERM (clean shutdown), 1 when a worker process died or failed to
start, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
from dataclasses import replace
from pathlib import Path

from unifiedserve.engine.config import EngineConfig
from unifiedserve.engine.scheduler import GPU_TOKEN_BUDGETS, SchedulerConfig, server_token_budgets
from unifiedserve.runtime.config import POLICIES, VISION_DEVICES, PoolBudgets, RuntimeConfig
from unifiedserve.runtime.shm import DEFAULT_SHM_DIR
from unifiedserve.runtime.worker import setup_logging
from unifiedserve.server.http_protocol import uvicorn_options
from unifiedserve.server.limits import (BODY_ROOM_WAIT_S, QWEN_MAX_FRAMES, QWEN_MAX_PIXELS, BodyBudget, BodySizeLimit,
                                        RequestLimits)
from unifiedserve.server.media import MediaPolicy

log = logging.getLogger("unifiedserve")

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
WORKER_DEATH_GRACE_S = 2.0  # /health reports unhealthy this long before the server exits
OPEN_FILES_TARGET = 65536  # the soft limit the server asks for (client connections are descriptors)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from unifiedserve.model.presets import DEFAULT_DEMO_PATH

    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="PATH",
                   help=f"Hugging Face checkpoint folder of a Qwen2.5-VL-family model (default: the demo model at "
                        f"{DEFAULT_DEMO_PATH}, written on first run)")
    g.add_argument("--served-model-name", type=_model_name, default=None,
                   help="model id in the API (default: the folder's name)")
    g.add_argument("--device", type=_device_arg, default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                   help="where the model runs (default auto: CUDA when torch sees a GPU, else CPU)")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights and activations (default auto: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never replay CUDA graphs for decode (CUDA only; on CPU decode is always eager)")
    g.add_argument("--async-scheduling", action="store_true",
                   help="launch each decode-only step before reading the previous one's tokens back, so the host's "
                        "per-step work overlaps the GPU's (tokens come out one step later; the same tokens)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="CUDA: size the KV cache to fill this share of the GPU's memory (e.g. 0.9, as in vLLM), "
                        "after what every process of the server holds there: measured at start-up by a profile "
                        "process (weights, buffers, peak prefill/encode and decode steps, CUDA graphs, contexts), "
                        "plus --vision-ahead-gb and a decoder allowance. Instead of --kv-cache-gb / --num-kv-blocks "
                        "(default on CUDA: 0.9 when neither is given)")
    g.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest prompt + completion in tokens, visual tokens included (default: the model's, "
                        "capped by the KV cache)")
    g.add_argument("--default-max-tokens", type=_positive_int, default=RuntimeConfig.default_max_tokens,
                   help="completion length when a request gives no max_tokens (default %(default)s)")
    g.add_argument("--generation-config", default="auto", metavar="{auto,none,DIR}",
                   help="defaults for the sampling fields a request leaves out (temperature, top_p, top_k, min_p, "
                        "repetition_penalty; max_tokens at most its max_new_tokens): auto (default) takes them from "
                        "the model's generation_config.json, as transformers and vLLM do; none: the OpenAI API's "
                        "(temperature 1, no top_p/top_k, no penalty); DIR: from DIR/generation_config.json")

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    g.add_argument("--api-key", default=os.environ.get("UNIFIEDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $UNIFIEDSERVE_API_KEY, or none)")
    g.add_argument("--policy", choices=POLICIES, default=RuntimeConfig.policy,
                   help="unified (default): encode+prefill (core) and decode in separate processes sharing every "
                        "core/device and the KV cache, decode at priority (see --decode-threads). monolithic: one process batches decode tokens into the "
                        "encode/prefill iterations (vLLM/SGLang chunked prefill; the encoder blocks decode). "
                        "split: core and decode on disjoint CPU sets (half each) with matching thread counts "
                        "(DistServe/EPD style)")
    g.add_argument("--startup-timeout", type=_positive_float, default=600.0, help="seconds to wait for the workers (default 600)")

    g = p.add_argument_group("media")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="allow file:// media URLs under DIR (default: file:// refused)")
    g.add_argument("--allowed-media-domains", nargs="*", default=(), metavar="HOST",
                   help="allow http(s) media URLs from these hosts (default: none)")
    g.add_argument("--max-media-mb", type=_positive_float, default=MediaPolicy.max_media_bytes / 2**20,
                   help="largest data: URL payload or download, in MiB (default %(default)g)")
    g.add_argument("--max-pixels", type=_positive_int, default=QWEN_MAX_PIXELS, metavar="N",
                   help=f"most pixels per image or video frame a request may ask for (min_pixels/max_pixels; "
                        f"default {QWEN_MAX_PIXELS}, Qwen2.5-VL's largest image budget)")
    g.add_argument("--max-frames", type=_frame_count, default=QWEN_MAX_FRAMES, metavar="N",
                   help=f"most frames sampled from one video (default {QWEN_MAX_FRAMES})")
    g.add_argument("--max-media-per-request", type=_positive_int, default=RequestLimits.max_media_per_request,
                   metavar="N", help="most image and video parts in one request (default %(default)s)")
    g.add_argument("--max-n", type=_positive_int, default=RequestLimits.max_n, metavar="N",
                   help="most choices one request may ask for (OpenAI's n, times the prompts of a /v1/completions "
                        "batch); each is a sequence of its own that shares its prompt's KV through the prefix "
                        "cache (default %(default)s)")
    g.add_argument("--max-request-mb", type=_positive_float, default=RequestLimits.max_request_bytes / 2**20,
                   metavar="MB", help="largest request body in MiB, checked while it streams in: 413 above it "
                                      "(default %(default)g; "
                        "data: URLs count here, file:// and http(s) media do not)")
    g.add_argument("--max-inflight-request-mb", type=_positive_float, default=None, metavar="MB",
                   help="request bodies held at once, in MiB: those being read and those whose request is still "
                        "running, each counted at its Content-Length before it is read. A body that does not fit "
                        "waits for room (first come first served, nothing of it read) up to "
                        f"{BODY_ROOM_WAIT_S:g} s, then gets 503 with Retry-After (default: the larger of 1024 and 4 x "
                        "--max-request-mb)")
    g.add_argument("--max-video-seconds", type=_positive_float, default=RuntimeConfig.max_video_seconds,
                   help="refuse longer videos (default %(default)g)")
    g.add_argument("--vision-threads", type=int, default=RuntimeConfig.vision_threads,
                   help="FlashCodec decoder threads shared by all requests (default: one per core)")
    g.add_argument("--vision-device", choices=VISION_DEVICES, default=RuntimeConfig.vision_device,
                   help="where the vision process decodes videos on a CUDA server. auto (default): the GPU's NVDEC "
                        "sessions and --vision-threads CPU decoders together (NVDEC where it works, with one log line "
                        "when it does not); cuda: NVDEC only (the CPU decoders take only what NVDEC cannot, e.g. "
                        "AV1 on an H100); cpu: the CPU decoders only. Frames are resized and cut into patches on the "
                        "GPU, straight into the shared patch buffer, in every case. Images: nvJPEG batches on the GPU "
                        "(other formats on CPU threads) under auto and cuda where nvJPEG works, else the CPU with "
                        "one log line; cpu decodes them on the CPU. A CPU server decodes on the CPU (cuda is "
                        "refused there)")
    g.add_argument("--vision-ahead-gb", type=_positive_float, default=RuntimeConfig.vision_ahead_gb, metavar="GB",
                   help="decoded patches the vision process may hold for requests that wait to be admitted (on the "
                        "GPU on a CUDA server); further videos, and further requests' images, are decoded when an "
                        "earlier request is admitted or cancelled (a video also when its own request is "
                        "admitted), so a queue of long videos or of large images cannot exhaust memory (default "
                        "%(default)g)")
    g.add_argument("--ingest", choices=("streaming", "whole"),
                   default="streaming" if RuntimeConfig.streaming_ingest else "whole",
                   help="streaming: vision writes each video's temporal slices into the patch buffer as they are "
                        "decoded and core encodes them at once; whole: a video is handed to core once it is all "
                        "decoded (to measure the difference) (default %(default)s)")

    g.add_argument("--decode-threads", type=int, default=0,
                   help="unified on CPU: torch threads of the decode process, which runs at normal priority while "
                        "vision and core are niced; core uses the remaining cores while any request decodes or vision "
                        "decodes a running request's video, and every core otherwise (default: a quarter of the "
                        "cores, at least 1)")

    g = p.add_argument_group("scheduling (Algorithm 3)")
    g.add_argument("--prefill-token-budget", type=_positive_int, default=None, metavar="TAU",
                   help=f"prompt tokens prefilled per core iteration (default {SchedulerConfig.prefill_token_budget} "
                        f"on the CPU, {GPU_TOKEN_BUDGETS['prefill_token_budget']} on a GPU, or derived from "
                        f"--tbt-slo-ms)")
    g.add_argument("--encode-token-budget", type=_positive_int, default=None, metavar="ALPHA",
                   help=f"patch tokens encoded per core iteration (default {SchedulerConfig.encode_token_budget} "
                        f"on the CPU, {GPU_TOKEN_BUDGETS['encode_token_budget']} on a GPU, or derived from "
                        f"--tbt-slo-ms)")
    g.add_argument("--tbt-slo-ms", type=_positive_float, default=None,
                   help="derive both budgets from this time-between-tokens SLO by a short profile at start "
                        "(cached per model, device and dtype); explicit budget flags win")
    g.add_argument("--max-num-seqs", type=_positive_int, default=SchedulerConfig.max_num_seqs,
                   help="requests admitted to encode/prefill at once (default %(default)s)")
    g.add_argument("--max-decode-batch", type=_positive_int, default=SchedulerConfig.max_decode_batch,
                   help="requests decoded together at most (default %(default)s)")

    g = p.add_argument_group("memory pools")
    g.add_argument("--kv-cache-gb", type=_positive_float, default=None,
                   help=f"KV cache size in GiB (default {PoolBudgets.kv_cache_gb:g}; on CUDA see also "
                        f"--gpu-memory-utilization)")
    g.add_argument("--num-kv-blocks", type=_positive_int, default=None, help="KV cache size in blocks (overrides --kv-cache-gb)")
    g.add_argument("--block-size", type=_positive_int, default=EngineConfig.block_size,
                   help="tokens per KV block (default %(default)s)")
    g.add_argument("--patch-buffer-gb", type=_positive_float, default=PoolBudgets.patch_buffer_gb,
                   help="patch buffer (vision -> encode) in GiB; one request's patches must fit (default %(default)g)")
    g.add_argument("--visual-buffer-gb", type=_positive_float, default=PoolBudgets.visual_buffer_gb,
                   help="visual-token buffer (encode -> prefill) in GiB (default %(default)g)")
    g.add_argument("--page-size", type=_positive_int, default=EngineConfig.page_size,
                   help="rows per page of both buffers (default %(default)s)")
    g.add_argument("--shm-dir", default=DEFAULT_SHM_DIR, help=f"tmpfs folder for the CPU pools (default {DEFAULT_SHM_DIR})")

    g = p.add_argument_group("GPU placement (CUDA; see docs/architecture.md and launch/serve-node.sh)")
    g.add_argument("--gpus", type=_gpu_list, default=None, metavar="N[,M]",
                   help="physical GPU ordinals the server uses: one (vision, core and decode share it), or two for "
                        "--policy split (default: GPU 0, or the N of --device cuda:N)")
    g.add_argument("--decode-sm-percent", type=_sm_percent, default=None, metavar="PCT",
                   help="decode's share of the SMs in percent, 1..99: guaranteed under --policy unified (vision and "
                        "core are capped at the rest), its whole share under split on one GPU (default 30)")
    g.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                   help="share the GPU through an MPS daemon (launch/mps.sh start): auto uses one when its control "
                        "pipe is there, on refuses to start without one, off time-slices (default auto)")

    from unifiedserve.ray_serve.launch import add_ray_arguments  # imports no Ray

    add_ray_arguments(p)

    g = p.add_argument_group("caching (a video's follow-up questions skip its decode, encode and prefill)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not reuse the KV cache of full prompt blocks across requests (on by default: blocks are "
                        "keyed by their tokens and, for visual tokens, the media's identity and options)")
    g.add_argument("--media-cache-gb", type=_non_negative_float, default=EngineConfig.media_cache_gb, metavar="GB",
                   help="keep encoded visual tokens of this much media, by media identity, least recently used out, "
                        "so media seen before is neither decoded nor encoded again (default %(default)g; 0 turns it "
                        "off)")


def _model_name(value: str) -> str:
    """argparse type of --served-model-name: a non-empty id without surrounding spaces."""
    if not value.strip() or value != value.strip():
        raise argparse.ArgumentTypeError(f"must be a non-empty name without surrounding spaces, got {value!r}")
    return value


def _positive_int(value: str, least: int = 1) -> int:
    """argparse type: an integer >= ``least`` (a zero or negative size is a mistake, never "use the default")."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
    return n


def _frame_count(value: str) -> int:
    """argparse type of --max-frames: at least 2, one temporal patch."""
    return _positive_int(value, 2)


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {value}")
    return x


def _non_negative_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return x


def _port(value: str) -> int:
    n = _positive_int(value)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 1..65535, got {n}")
    return n


def _gpu_list(value: str) -> list[int]:
    parts = value.split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"must be GPU ordinals separated by commas (e.g. 0 or 0,1), got {value!r}")
    return [int(p) for p in parts]


def _sm_percent(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if not 1 <= n <= 99:
        raise argparse.ArgumentTypeError(f"must be a percentage in 1..99, got {n}")
    return n


DEFAULT_DECODE_SM_PERCENT = 30


def gpu_placement_fields(args: argparse.Namespace, device: str, num_visible_gpus: int,
                         mps_running: bool) -> dict:
    """The RuntimeConfig fields that place the workers on GPUs (``gpu``, ``process_env``), or ``{}`` on the CPU.

    Raises:
        ValueError: a GPU flag on the CPU, ``--gpus`` against ``--device cuda:N``, ``--mps on`` without a
            daemon, two GPUs (their KV would have to move between devices, which is not built), or what
            :func:`~unifiedserve.runtime.gpu_placement.plan_gpu_placement` refuses.
    """
    from unifiedserve.runtime.gpu_placement import plan_gpu_placement

    if device == "cpu":
        given = [flag for flag, value in (("--gpus", args.gpus), ("--decode-sm-percent", args.decode_sm_percent),
                                          ("--mps", None if args.mps == "auto" else args.mps)) if value is not None]
        if given:
            raise ValueError(f"{given[0]} applies to CUDA only and the server runs on the CPU")
        return {}
    gpus = args.gpus
    if device.startswith("cuda:"):
        if gpus is not None and gpus[:1] != [int(device[5:])]:
            raise ValueError(f"--device {device} and --gpus {','.join(map(str, gpus))} disagree; give one of them")
        gpus = gpus or [int(device[5:])]
    if args.mps == "on" and not mps_running:
        raise ValueError("--mps on: no MPS daemon answers at CUDA_MPS_PIPE_DIRECTORY; start one with "
                         "launch/mps.sh start (or launch/serve-node.sh), or use --mps off")
    placement = plan_gpu_placement(args.policy, num_visible_gpus, gpus,
                                   args.decode_sm_percent or DEFAULT_DECODE_SM_PERCENT,
                                   use_mps=mps_running and args.mps != "off")
    physical = sorted({p.gpu for p in placement.processes.values()})
    if len(physical) > 1:
        raise ValueError(f"--gpus {','.join(map(str, physical))}: decode on its own GPU needs the KV cache moved "
                         f"between GPUs, which this server does not do yet; use one GPU (--policy split shares it "
                         f"through MPS)")
    for note in placement.notes:
        log.warning("%s", note)
    return {"gpu": physical[0], "process_env": {name: placement.env(name) for name in placement.processes}}


def _device_arg(value: str) -> str:
    if not _DEVICE_RE.match(value):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from auto, cpu, cuda, cuda:N)")
    return value


def run(args: argparse.Namespace) -> int:
    setup_logging("api")
    limits = request_limits(args)  # before anything is built or spawned
    media_policy(args)  # a bad --allowed-local-media-path is refused now, not after the workers start
    generation_defaults(args, args.model)  # and a bad generation config
    from unifiedserve.ray_serve.launch import ray_requested, run_ray  # imports no Ray

    if ray_requested(args):  # replicas on Ray Serve (unifiedserve[ray]); only run_ray imports Ray
        return run_ray(args, limits)
    runtime = build_runtime(args)  # the flags' own contradictions first: nothing is spawned yet
    raise_open_file_limit()
    sock = bind_socket(args.host, args.port)  # a port in use is one error line, before any worker starts
    try:
        return asyncio.run(_serve(runtime, args, limits, sock))
    finally:
        sock.close()


def raise_open_file_limit(target: int = OPEN_FILES_TARGET) -> int:
    """Raise this process's soft limit on open files towards ``target`` (never past the hard limit), as vLLM
    does: each client connection is a descriptor, and Debian's default soft limit (1024) is reached by a few
    hundred streams plus the runtime's own. Returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d (%s): at most about %d connections",
                        soft, wanted, e, soft)
    return soft


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening address, bound now (it listens once the workers are ready: until then a client
    is refused, as before). Raises ``ValueError`` naming the flag when the host does not resolve or the
    address is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses TIME_WAIT
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {e.strerror}") from None
    return sock


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
    elif not (Path(model) / "config.json").is_file():
        raise ValueError(f"--model {model}: no config.json there; give a Hugging Face checkpoint folder")
    return model


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
    from unifiedserve.runtime.launcher import Runtime, build_config

    model = resolve_model(args.model)
    budgets = server_token_budgets(device, {k: v for k, v in (("prefill_token_budget", args.prefill_token_budget),
                                                              ("encode_token_budget", args.encode_token_budget))
                                            if v is not None}, args.tbt_slo_ms)
    try:  # the config tree checks every value once; a refusal names the flag it came from
        sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_decode_batch=args.max_decode_batch,
                                patches_ready_on_admit=False, **budgets)
        engine = EngineConfig(device=device, dtype=dtype, block_size=args.block_size, page_size=args.page_size,
                              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
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
            max_video_seconds=args.max_video_seconds, streaming_ingest=args.ingest == "streaming",
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
    return ServerState(client, processor, metrics, media_policy(args),
                       config.served_model_name, config.max_model_len, config.default_max_tokens,
                       tuple(model_config.eos_token_ids), config.policy, args.api_key, limits, generation=generation,
                       vocab_size=model_config.text.vocab_size)


async def _serve(runtime, args, limits: RequestLimits, sock: socket.socket | None = None) -> int:
    import uvicorn

    from unifiedserve.server.api import build_app
    from unifiedserve.server.engine_client import EngineClient

    config = runtime.config
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    server: uvicorn.Server | None = None

    def on_signal(signum, frame):  # also what uvicorn re-raises after its own graceful exit
        runtime.stopping = True  # workers that exit from now on are not failures
        loop.call_soon_threadsafe(stop.set)
        if server is not None:
            server.should_exit = True
            loop.call_soon_threadsafe(_drain)

    def _drain():  # in-flight requests end now with a 503 instead of being cut off after the grace period
        if state is not None:
            state.draining = True
        client.fail_all("the server is shutting down", 503)

    state = None

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    client = EngineClient(runtime)
    await client.start()
    try:
        runtime.create_pools()
        runtime.start()
        log.info("starting workers (vision, core, decode); instance %s, sockets in %s", runtime.instance,
                 runtime.ipc_dir)
        ready = asyncio.create_task(client.wait_ready(args.startup_timeout))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            log.info("interrupted during start-up")
            return 0
        stopped.cancel()
        try:
            infos = ready.result()
        except RuntimeError as e:
            log.error("start-up failed: %s", e)
            return 1
        runtime.all_mapped()
        for name in config.processes:
            info = infos[name]
            log.info("%s (pid %d): %s", name, info.pid, ", ".join(f"{k}={v}" for k, v in info.info.items()))
        log.info("pools: KV cache %d blocks x %d tokens, patch buffer %d pages, visual-token buffer %d pages "
                 "(page = %d rows); max model len %d; policy %s", config.engine.num_kv_blocks, config.engine.block_size,
                 config.engine.num_patch_pages, config.engine.num_visual_pages, config.engine.page_size,
                 config.max_model_len,
                 config.policy)
        state = build_state(runtime, client, args, limits)
        metrics = state.metrics
        state.body_budget = BodyBudget(limits.inflight_request_bytes)  # behind --ray, the ingress holds its own
        app = BodySizeLimit(build_app(state), limits.max_request_bytes, state.body_budget)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                               access_log=False, timeout_graceful_shutdown=5,
                                               **uvicorn_options()))
        uvicorn_handle_exit = server.handle_exit

        def handle_exit(sig, frame):  # uvicorn's own signal handler while it serves
            uvicorn_handle_exit(sig, frame)
            runtime.stopping = True
            loop.call_soon_threadsafe(_drain)

        server.handle_exit = handle_exit

        def on_fatal():
            metrics.healthy.set(0)
            loop.call_later(WORKER_DEATH_GRACE_S, setattr, server, "should_exit", True)

        client.on_fatal = on_fatal
        if stop.is_set():
            return 0
        log.info("serving %s on http://%s:%d (OpenAI API at /v1)", config.served_model_name, args.host, args.port)
        await server.serve(sockets=None if sock is None else [sock])
        if not server.started and not stop.is_set() and not client.fatal:
            log.error("the HTTP server could not start (is port %d free?)", args.port)
            return 1
        return 1 if client.fatal else 0
    finally:
        await client.close()
        runtime.stop()
        log.info("stopped")
