"""Prometheus metrics of one server: latencies, per-stage times, queue sizes and pool usage."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flashcodec.telemetry import register_prometheus
from unifiedserve.runtime.worker import IterationCounters

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                    7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)

STAGES = ("probe", "video_decode", "queue", "encode", "prefill")

#: a request's way to its first token, in the order it usually goes (unifiedserve_request_milestone_seconds)
MILESTONES = ("probed", "decode_start", "added", "admitted", "first_part_decoded", "first_part_written",
              "first_part_ready", "media_ready", "encode_start", "prefill_start", "first_token")

#: worker gauges exported as pool usage: (pool, used key, total key)
_POOLS = (("kv_blocks", "kv_blocks_used", "kv_blocks_total"), ("patch_pages", "patch_pages_used", "patch_pages_total"),
          ("visual_pages", "visual_pages_used", "visual_pages_total"))


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        self.ttft = Histogram("unifiedserve_time_to_first_token_seconds", "Time to first token.",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram("unifiedserve_inter_token_latency_seconds", "Time between consecutive output tokens.",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("unifiedserve_e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)

        def latencies(name: str, doc: str, label: str, values) -> dict[str, Histogram]:
            """A latency histogram per value of ``label``."""
            family = Histogram(name, doc, ["model_name", label], buckets=_LATENCY_BUCKETS, registry=r)
            return {v: family.labels(**{label: v}, **labels) for v in values}

        self.stage = latencies(
            "unifiedserve_request_stage_seconds",
            "Time a request spent in each stage before its first token: probe (api sends the media to vision .. "
            "grids known), video_decode (frames decoded and patches written), queue (waiting for patch pages), "
            "encode (first .. last vision-encoder step), prefill (first .. last prefill chunk). Stages may overlap.",
            "stage", STAGES)
        self.first_encode_lag = Histogram(
            "unifiedserve_request_first_encode_lag_seconds",
            "From the start of a request's media decoding (vision) to the start of its first vision-encoder step "
            "(core): how long encoding waits on decoding. Streaming ingest keeps it near one temporal slice's "
            "decode; whole-video hand-off makes it at least the whole decode.",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.milestone = latencies(
            "unifiedserve_request_milestone_seconds",
            "Seconds from a request's arrival to each milestone on its way to its first token, each stamped by the "
            "process that saw it (one host's wall clock): probed (api has the media's grids), decode_start (vision "
            "began decoding its first video), added (core has the request), admitted (core gave it patch pages), "
            "first_part_decoded / first_part_written / first_part_ready (its first rows of patches: FlashCodec "
            "handed them to vision, vision had written them into the pages, core had the message), media_ready "
            "(every media written), encode_start, prefill_start, first_token. A milestone the request never "
            "reached (a text prompt's decode) is not observed.",
            "milestone", MILESTONES)
        self.requests = Counter("unifiedserve_requests", "Finished requests by finish reason.",
                                ["model_name", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("unifiedserve_prompt_tokens", "Prompt tokens (visual tokens included).",
                                     ["model_name"], registry=r).labels(**labels)
        self.generation_tokens = Counter("unifiedserve_generation_tokens", "Generated tokens.", ["model_name"],
                                         registry=r).labels(**labels)
        self.running = Gauge("unifiedserve_num_requests_running", "Requests admitted: encoding, prefilling or "
                             "decoding.", ["model_name"], registry=r).labels(**labels)
        self.waiting = Gauge("unifiedserve_num_requests_waiting", "Requests whose prefill has not started: probing, "
                             "decoding video, or waiting for patch pages or KV blocks.", ["model_name"],
                             registry=r).labels(**labels)
        pool_used = Gauge("unifiedserve_pool_used", "Pages or blocks in use, per pool.", ["model_name", "pool"],
                          registry=r)
        pool_total = Gauge("unifiedserve_pool_capacity", "Pages or blocks, per pool.", ["model_name", "pool"],
                           registry=r)
        self._pool = {p: (pool_used.labels(pool=p, **labels), pool_total.labels(pool=p, **labels), u, t)
                      for p, u, t in _POOLS}
        # caches (core's running totals): prompt tokens asked of / found in the prefix cache, visual
        # tokens asked of / found in the media cache (media the prefix cache covered are not asked)
        self._caches = {}
        for cache, what in (("prefix_cache", "prompt tokens"), ("media_cache", "visual tokens")):
            queried = Gauge(f"unifiedserve_{cache}_queries_tokens", f"{what.capitalize()} looked up in the "
                            f"{cache.replace('_', ' ')} since start.", ["model_name"], registry=r).labels(**labels)
            hits = Gauge(f"unifiedserve_{cache}_hits_tokens", f"{what.capitalize()} found in the "
                         f"{cache.replace('_', ' ')} since start.", ["model_name"], registry=r).labels(**labels)
            rate = Gauge(f"unifiedserve_{cache}_hit_rate", f"Hits / queries of the {cache.replace('_', ' ')} "
                         f"since start, in {what}.", ["model_name"], registry=r).labels(**labels)
            self._caches[cache] = (queried, hits, rate)
        self.media_cache_bytes = Gauge("unifiedserve_media_cache_bytes", "Bytes of encoded visual tokens the media "
                                       "cache holds.", ["model_name"], registry=r).labels(**labels)
        self.vision_ahead_bytes = Gauge("unifiedserve_vision_ahead_bytes", "Patches the vision process holds ahead "
                                        "of their request's admission (videos decoding or decoded, as planned; "
                                        "images decoded), bounded by --vision-ahead-gb.", ["model_name"],
                                        registry=r).labels(**labels)
        self.vision_waiting = Gauge("unifiedserve_vision_videos_waiting", "Probed videos whose decode waits for the "
                                    "--vision-ahead-gb bound or for their request's admission.", ["model_name"],
                                    registry=r).labels(**labels)
        self.vision_probes_waiting = Gauge("unifiedserve_vision_probes_waiting", "Requests with images whose probe "
                                           "(which decodes the images) waits for the --vision-ahead-gb bound.",
                                           ["model_name"], registry=r).labels(**labels)
        self._pool_bytes = Gauge("unifiedserve_pool_bytes", "Bytes of each shared pool, allocated once at start "
                                 "(kv: the KV cache; patch: the patch buffer; weights: the LLM weights core and "
                                 "decode share), and where it lives (cpu: shared memory; cuda:N: the GPU).",
                                 ["model_name", "pool", "device"], registry=r)
        self._process_memory = Gauge("unifiedserve_process_memory_bytes", "Memory of each worker process by kind: "
                                     "weights_own (parameters it allocated), weights_shared (parameters it maps from "
                                     "the shared weights pool, counted once in unifiedserve_pool_bytes), and on CUDA "
                                     "device_allocated and device_peak (torch's allocator: activations, its own "
                                     "weights, caches; the mapped pools are not in it).",
                                     ["model_name", "process", "kind"], registry=r)
        self._ipc_bytes = Gauge("unifiedserve_ipc_sent_bytes", "Bytes of the messages each process has sent each "
                                "other process since start (ZMQ; the workers' own stats reports excluded). Only "
                                "control messages and page indices cross: patches, visual tokens and KV stay in "
                                "the shared pools, so this stays far below the bytes of the media served.",
                                ["model_name", "src", "dst"], registry=r)
        self._iterations = Gauge("unifiedserve_engine_iterations", "Engine iterations (steps that ran something) "
                                 "per process since start: core (encode, prefill, and decode under --policy "
                                 "monolithic) and decode.", ["model_name", "process"], registry=r)
        self._busy = Gauge("unifiedserve_engine_busy_seconds", "Wall time of those iterations per process (on CUDA "
                           "the host's: launching them, and waiting for the device where a step reads back); "
                           "its difference over a window divided by the iterations' is the mean iteration time.",
                           ["model_name", "process"], registry=r)
        self._encode_time = Gauge("unifiedserve_engine_encode_seconds", "Time of the vision encode inside the "
                                  "iterations (device time on CUDA).", ["model_name", "process"], registry=r)
        self._iteration_tokens = Gauge("unifiedserve_engine_tokens", "Tokens the iterations ran, per process and "
                                       "kind: encode (patch tokens through the vision tower), prefill (prompt "
                                       "tokens), decode (one per decoding request and step).",
                                       ["model_name", "process", "kind"], registry=r)
        self.healthy = Gauge("unifiedserve_healthy", "1 while every worker process is alive.", ["model_name"],
                             registry=r).labels(**labels)
        self.healthy.set(1)
        self.request_body_bytes = Gauge("unifiedserve_request_body_bytes", "Bytes of request bodies held now: "
                                        "being read, or kept by their running request (at most "
                                        "--max-inflight-request-mb).", ["model_name"], registry=r).labels(**labels)
        # NVDEC/NVJPG utilisation per GPU and engine, read from NVML at each scrape; none without NVML
        self.has_gpu_telemetry = register_prometheus(r, prefix="unifiedserve")

    def finished(self, reason: str) -> None:
        self.requests.labels(finish_reason=reason, **self._labels).inc()

    def set_pools(self, pools: dict[str, tuple[int, str]]) -> None:
        """``{pool: (bytes, device)}`` of the runtime's shared pools (fixed for the server's life)."""
        for pool, (num_bytes, device) in pools.items():
            self._pool_bytes.labels(pool=pool, device=device, **self._labels).set(num_bytes)

    def update_processes(self, gauges_by_worker: dict[str, dict[str, float]],
                         api_sent_bytes: dict[str, int] | None = None) -> None:
        """Each worker's ``mem_<kind>_bytes`` gauges, as ``unifiedserve_process_memory_bytes{process, kind}``,
        its ``ipc_to_<peer>_bytes`` (plus the api process's own sends) as ``unifiedserve_ipc_sent_bytes``, and its
        iteration counters as ``unifiedserve_engine_{iterations,busy_seconds,encode_seconds,tokens}``."""
        for process, gauges in gauges_by_worker.items():
            if f"{process}_iterations" in gauges:  # runtime/worker.py: IterationCounters
                self._iterations.labels(process=process, **self._labels).set(gauges[f"{process}_iterations"])
                self._busy.labels(process=process, **self._labels).set(gauges[f"{process}_busy_seconds"])
                self._encode_time.labels(process=process, **self._labels).set(gauges[f"{process}_encode_seconds"])
                for kind in IterationCounters.KINDS:
                    self._iteration_tokens.labels(process=process, kind=kind, **self._labels).set(
                        gauges[f"{process}_{kind}_tokens"])
            for key, value in gauges.items():
                if key.startswith("mem_") and key.endswith("_bytes"):
                    self._process_memory.labels(process=process, kind=key[4:-6], **self._labels).set(value)
                elif key.startswith("ipc_to_") and key.endswith("_bytes"):
                    self._ipc_bytes.labels(src=process, dst=key[7:-6], **self._labels).set(value)
        for peer, value in (api_sent_bytes or {}).items():
            self._ipc_bytes.labels(src="api", dst=peer, **self._labels).set(value)

    def update_workers(self, gauges: dict[str, float], num_in_api: int) -> None:
        """From the workers' latest stats; ``num_in_api``: requests the api holds that core has not seen."""
        for used, total, used_key, total_key in self._pool.values():
            if used_key in gauges:
                used.set(gauges[used_key])
                total.set(gauges[total_key])
        for cache, (queried, hits, rate) in self._caches.items():
            if f"{cache}_queried_tokens" in gauges:
                q, h = gauges[f"{cache}_queried_tokens"], gauges[f"{cache}_hit_tokens"]
                queried.set(q)
                hits.set(h)
                rate.set(h / q if q else 0.0)
        if "media_cache_bytes" in gauges:
            self.media_cache_bytes.set(gauges["media_cache_bytes"])
        if "vision_ahead_bytes" in gauges:
            self.vision_ahead_bytes.set(gauges["vision_ahead_bytes"])
            self.vision_waiting.set(gauges["vision_waiting"])
            self.vision_probes_waiting.set(gauges["vision_probes_waiting"])
        self.waiting.set(gauges.get("num_waiting", 0) + num_in_api)
        self.running.set(gauges.get("num_prefilling", 0) + gauges.get("num_decoding", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
