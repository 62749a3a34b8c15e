"""``unifiedserve serve``'s flags: their definitions, defaults (from the config dataclasses) and help, and the
argparse types that refuse a bad value with one line before anything starts.
"""

from __future__ import annotations

import argparse
import os
import re

from unifiedserve.engine.config import EngineConfig
from unifiedserve.engine.scheduler import GPU_TOKEN_BUDGETS, SCHEDULING_POLICIES, SchedulerConfig
from unifiedserve.runtime.config import POLICIES, VISION_DEVICES, PoolBudgets, RuntimeConfig
from unifiedserve.runtime.shm import DEFAULT_SHM_DIR
from unifiedserve.server.limits import BODY_ROOM_WAIT_S, QWEN_MAX_FRAMES, QWEN_MAX_PIXELS, RequestLimits
from unifiedserve.server.media import MediaPolicy

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def async_scheduling_default(flag: bool | None, device: str) -> bool:
    """``--async-scheduling`` / ``--no-async-scheduling`` as given, else on for a CUDA server (vLLM's default since
    0.14: the host's per-step work hides behind the GPU's) and off on the CPU (nothing overlaps there, and the extra
    row per request makes a step slower: docs/architecture.md)."""
    return device != "cpu" if flag is None else flag


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
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each decode-only step before reading the previous one's tokens back, so the host's "
                        "per-step work overlaps the GPU's (tokens come out one step later; the same tokens). "
                        "Default: on with CUDA (as in vLLM), off on the CPU, where nothing overlaps and the extra "
                        "row per request makes it slower")
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
                   help="require 'Authorization: Bearer KEY' on /v1 routes and /(de)tokenize, checked before a request "
                        "body is read (default: $UNIFIEDSERVE_API_KEY, or none)")
    g.add_argument("--policy", choices=POLICIES, default=RuntimeConfig.policy,
                   help="unified (default): encode+prefill (core) and decode in separate processes sharing every "
                        "core/device and the KV cache, decode at priority (see --decode-threads). monolithic: one "
                        "process batches decode tokens into the "
                        "encode/prefill iterations (vLLM/SGLang chunked prefill; the encoder blocks decode). "
                        "split: core and decode on disjoint CPU sets (half each) with matching thread counts "
                        "(DistServe/EPD style)")
    g.add_argument("--startup-timeout", type=_positive_float, default=600.0,
                   help="seconds to wait for the workers (default 600)")
    g.add_argument("--worker-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="once serving, a worker process that sends nothing for this long (each reports every second "
                        "between its steps) counts as stuck, as a dead one does: in-flight requests fail, /health "
                        "turns 503 and the server exits 1; 0 never (default 300)")

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
    g.add_argument("--max-image-source-mp", type=_positive_float, default=RuntimeConfig.max_image_source_pixels / 1e6,
                   metavar="MP", help="refuse images whose stored size is larger, in megapixels, from their header "
                   "before any pixel is decoded (default %(default)g: a 48-MP phone photo fits; the vision process "
                   "needs about 10 bytes per pixel for each image it decodes at once)")
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
                        "(cached per model, device, dtype and SLO, on a GPU also per policy and core's SM share); "
                        "explicit budget flags win (default: none, the budgets' own defaults)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=SchedulerConfig.max_num_seqs,
                   help="requests admitted to encode/prefill at once (default %(default)s)")
    g.add_argument("--max-decode-batch", type=_positive_int, default=SchedulerConfig.max_decode_batch,
                   help="requests decoded together at most (default %(default)s)")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=SchedulerConfig.scheduling_policy,
                   help="who gets the encode and prefill budgets first: srpt, the request with the fewest prompt "
                        "tokens left to prefill, in whole prefill budgets, the oldest first within one (a short "
                        "question is not held behind a long video; one passed over "
                        f"{SchedulerConfig.max_passed_steps} times goes first), or fcfs, the oldest; buffer pages go "
                        "in arrival order either way, KV blocks too but for a bounded number of overtakes "
                        "(default %(default)s)")

    g = p.add_argument_group("memory pools")
    g.add_argument("--kv-cache-gb", type=_positive_float, default=None,
                   help=f"KV cache size in GiB (default {PoolBudgets.kv_cache_gb:g}; on CUDA see also "
                        f"--gpu-memory-utilization)")
    g.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                   help="KV cache size in blocks (overrides --kv-cache-gb)")
    g.add_argument("--block-size", type=_positive_int, default=EngineConfig.block_size,
                   help="tokens per KV block (default %(default)s)")
    g.add_argument("--patch-buffer-gb", type=_positive_float, default=PoolBudgets.patch_buffer_gb,
                   help="patch buffer (vision -> encode) in GiB; one request's patches must fit (default %(default)g)")
    g.add_argument("--visual-buffer-gb", type=_positive_float, default=PoolBudgets.visual_buffer_gb,
                   help="visual-token buffer (encode -> prefill) in GiB (default %(default)g)")
    g.add_argument("--page-size", type=_positive_int, default=EngineConfig.page_size,
                   help="rows per page of both buffers (default %(default)s)")
    g.add_argument("--shm-dir", default=DEFAULT_SHM_DIR,
                   help=f"tmpfs folder for the CPU pools (default {DEFAULT_SHM_DIR})")

    g = p.add_argument_group("GPU placement (CUDA; see docs/architecture.md and launch/serve-node.sh)")
    g.add_argument("--gpus", type=_gpu_list, default=None, metavar="N[,M]",
                   help="physical GPU ordinals the server uses: one (vision, core and decode share it), or two for "
                        "--policy split (default: GPU 0, or the N of --device cuda:N)")
    g.add_argument("--decode-sm-percent", type=_sm_percent, default=None, metavar="PCT",
                   help="decode's share of the SMs in percent: guaranteed under --policy unified (vision and core "
                        "are capped at the rest; 0: nobody is capped, and core's token budgets alone keep decode's "
                        "pace), its whole share under split on one GPU, 1..99 (default 30; monolithic has no "
                        "decode process)")
    g.add_argument("--mps-priority", action="store_true",
                   help="under MPS, vision and core run as below-normal-priority clients and decode as a normal "
                        "one (CUDA_MPS_CLIENT_PRIORITY), so decode's waiting work is dispatched first; with "
                        "--decode-sm-percent 0 that is the paper's sharing (unified and split; off by default: "
                        "measure it first, bench/kernels/bench_sm_shares.py --modes alone,unified:0,priority:0)")
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
    if not 0 <= n <= 99:
        raise argparse.ArgumentTypeError(f"must be a percentage in 0..99 (0: no caps, unified only), got {n}")
    return n


DEFAULT_DECODE_SM_PERCENT = 30


def _device_arg(value: str) -> str:
    if not _DEVICE_RE.match(value):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from auto, cpu, cuda, cuda:N)")
    return value
