"""Starting and stopping a server instance's worker processes and shared pools (in the api process).

:func:`build_config` sizes the pools from memory budgets; :class:`Runtime` creates the pools and
the private ZMQ folder, spawns the vision, core and decode workers, and tears everything down:
workers get ``Shutdown`` and are then terminated, pool files are unlinked as soon as every worker
has mapped them, and the ZMQ folder is removed. A server killed with ``kill -9`` leaves its ZMQ folder; the next
server to start removes it (:func:`remove_stale_ipc_dirs`).
"""

from __future__ import annotations

import glob
import logging
import multiprocessing as mp
import os
import shutil
import socket
import stat
import tempfile
import time
import uuid
from dataclasses import replace

import torch
import zmq

from unifiedserve.engine.config import EngineConfig
from unifiedserve.model.config import ModelConfig
from unifiedserve.runtime import protocol
from unifiedserve.runtime.config import PoolBudgets, RuntimeConfig
from unifiedserve.runtime.shm import DEFAULT_SHM_DIR, check_shm_space, create_cpu_pool, unlink_pool

log = logging.getLogger("unifiedserve")

GiB = 2**30


def served_name(model: str, served_model_name: str | None = None) -> str:
    """The model id the API serves: ``--served-model-name``, else the checkpoint folder's name."""
    return served_model_name or os.path.basename(str(model).rstrip("/"))


def build_config(model: str, engine: EngineConfig, budgets: PoolBudgets = PoolBudgets(), *,
                 served_model_name: str | None = None, max_model_len: int | None = None, decode_threads: int = 0,
                 **kwargs) -> RuntimeConfig:
    """A :class:`RuntimeConfig` over ``engine`` with its pools sized from ``budgets`` and the model's shapes.

    Args:
        engine: device, dtype, block and page size, budgets, caches of the server's engine cores; its
            pool sizes (``num_kv_blocks``, ``num_patch_pages``, ``num_visual_pages``) are replaced by
            the ones ``budgets`` give.
        kwargs: the other :class:`RuntimeConfig` fields (placement fields are filled here on the CPU).

    Raises:
        ValueError: a budget that holds no page, or ``max_model_len`` beyond the KV cache (naming the flags).
    """
    from unifiedserve.engine.llm import DTYPES
    from unifiedserve.model.weight_pool import llm_weight_bytes

    cfg = ModelConfig.from_json(os.path.join(model, "config.json"))
    itemsize = DTYPES[engine.dtype].itemsize
    text, vision = cfg.text, cfg.vision
    block_size, page_size = engine.block_size, engine.page_size
    kv_token_bytes = text.num_hidden_layers * 2 * text.num_key_value_heads * text.head_dim * itemsize
    num_kv_blocks = budgets.num_kv_blocks
    if num_kv_blocks is None:
        num_kv_blocks = int(budgets.kv_cache_gb * GiB) // (kv_token_bytes * block_size)
    num_patch_pages, num_visual_pages = buffer_pages(cfg, engine, budgets)
    for name, value, flag in (("KV cache", num_kv_blocks, "--kv-cache-gb / --num-kv-blocks"),
                              ("patch buffer", num_patch_pages, "--patch-buffer-gb"),
                              ("visual-token buffer", num_visual_pages, "--visual-buffer-gb")):
        if value < 1:
            raise ValueError(f"the {name} budget holds no page at all; raise {flag}")
    kv_tokens = num_kv_blocks * block_size
    if max_model_len is None:
        max_model_len = min(text.max_position_embeddings, kv_tokens)
    elif max_model_len > text.max_position_embeddings:  # positions past it were never trained (vLLM refuses too)
        raise ValueError(f"--max-model-len {max_model_len} is longer than the model's context "
                         f"(max_position_embeddings {text.max_position_embeddings} in its config.json)")
    elif max_model_len > kv_tokens:
        raise ValueError(f"--max-model-len {max_model_len} needs more KV cache than there is ({kv_tokens} tokens); "
                         f"raise --kv-cache-gb or lower --max-model-len")
    if engine.device == "cpu":
        kwargs.update(cpu_placement(kwargs.get("policy", RuntimeConfig.policy), sorted(os.sched_getaffinity(0)),
                                    decode_threads=decode_threads, vision_threads=kwargs.get("vision_threads", 0)))
    pool_shapes = {
        "kv": (text.num_hidden_layers, 2, num_kv_blocks, block_size, text.num_key_value_heads, text.head_dim),
        "patch": (num_patch_pages, page_size, vision.patch_dim),
        # one copy of the LLM's weights for core and decode (bytes: the parameters keep their dtypes)
        "weights": (llm_weight_bytes(cfg, DTYPES[engine.dtype]),),
    }
    engine = replace(engine, num_kv_blocks=num_kv_blocks, num_patch_pages=num_patch_pages,
                     num_visual_pages=num_visual_pages)
    return RuntimeConfig(model=model, served_model_name=served_name(model, served_model_name),
                         engine=engine, max_model_len=max_model_len, pool_shapes=pool_shapes, **kwargs)


def buffer_pages(cfg: ModelConfig, engine: EngineConfig, budgets: PoolBudgets) -> tuple[int, int]:
    """``(patch pages, visual-token pages)`` that ``budgets`` give for the model of ``cfg`` in ``engine``'s dtype."""
    from unifiedserve.engine.llm import DTYPES

    itemsize = DTYPES[engine.dtype].itemsize
    vision, page_size = cfg.vision, engine.page_size
    return (int(budgets.patch_buffer_gb * GiB) // (page_size * vision.patch_dim * itemsize),
            int(budgets.visual_buffer_gb * GiB) // (page_size * vision.out_hidden_size * itemsize))


#: Pools of raw bytes (views of several dtypes live in them), not of the model's dtype.
BYTE_POOLS = frozenset({"weights"})

UNIFIED_NICE = 5  # unified on CPU: vision and core yield to decode (the latency-critical stage)


def cpu_placement(policy: str, cpus: list[int], decode_threads: int = 0, vision_threads: int = 0) -> dict:
    """Per-process CPU sets, torch threads and priorities for a policy (RuntimeConfig fields).

    - ``split``: two disjoint halves, vision + core | decode, each sized to its half (DistServe/EPD).
    - ``unified``: every process may use every core. Decode runs ``decode_threads`` torch threads
      (default a quarter of the cores, at least 1) at normal priority; vision and core run niced
      (``UNIFIED_NICE``), and core drops to the cores decode leaves free while any request is
      decoding or vision is still decoding a running request's video (streaming ingest), then takes
      all of them back. Decode steps are not slowed by oversubscription, core's parallel regions
      do not wait at their barriers for a thread another process preempted, and encode+prefill
      gets every core whenever decode and vision are idle.
    - ``monolithic``: one compute process with torch's default threads.
    """
    if decode_threads < 0 or vision_threads < 0:
        raise ValueError("--decode-threads and --vision-threads must be >= 0 (0: automatic)")
    from flashcodec.devices import MAX_CPU_THREADS

    if vision_threads > MAX_CPU_THREADS:  # FlashCodec's own bound: refused here, not by the vision process
        raise ValueError(f"--vision-threads must be at most {MAX_CPU_THREADS} (one decoder thread each), "
                         f"got {vision_threads}")
    if decode_threads and policy != "unified":  # split sizes decode to its half; monolithic has no decode process
        raise ValueError(f"--decode-threads applies to --policy unified only (--policy {policy} sizes its own "
                         f"threads); leave it out")
    n = len(cpus)
    if policy == "split":
        half = max(1, n // 2)
        front, back = cpus[:half], cpus[half:] or cpus[-1:]
        return {"cpu_affinity": {"vision": front, "core": front, "decode": back},
                "torch_threads": {"core": len(front), "decode": len(back)},
                "vision_threads": vision_threads or len(front)}
    if policy == "unified":
        decode = min(n, decode_threads or max(1, n // 4))
        return {"torch_threads": {"core": n, "decode": decode},
                "core_threads_shared": max(1, n - decode),
                "nice": {"vision": UNIFIED_NICE, "core": UNIFIED_NICE}}
    return {}


def _worker_classes():
    from unifiedserve.runtime.core_worker import CoreWorker
    from unifiedserve.runtime.decode_worker import DecodeWorker
    from unifiedserve.runtime.vision_worker import VisionWorker

    return {"vision": VisionWorker, "core": CoreWorker, "decode": DecodeWorker}


#: a ZMQ folder whose sockets all refuse connections is another server's that was killed, once it is this old
#: (its workers bind their sockets within seconds of its making); one with no socket at all, once it is an hour old
STALE_IPC_AGE_S = 60.0
EMPTY_IPC_AGE_S = 3600.0


def remove_stale_ipc_dirs(parent: str | None = None) -> list[str]:
    """Remove the ZMQ folders (``unifiedserve-<instance>-*`` in the temp folder) that servers killed with ``kill -9``
    left: this user's, no socket in them accepting a connection (every process of that server is gone), and old
    enough that they are not a server starting now. Returns the folders removed; never raises."""
    removed = []
    now = time.time()
    for path in glob.glob(os.path.join(parent or tempfile.gettempdir(), "unifiedserve-" + "[0-9a-f]" * 12 + "-*")):
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            with os.scandir(path) as entries:
                sockets = [e.path for e in entries if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)]
            age = now - st.st_mtime
            if age < (STALE_IPC_AGE_S if sockets else EMPTY_IPC_AGE_S) or any(map(_accepts, sockets)):
                continue
            shutil.rmtree(path)
            removed.append(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed


def _accepts(path: str) -> bool:
    """Whether a process listens on the Unix socket ``path`` (True when it cannot be told)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
        return True


class Runtime:
    """The worker processes and pools of one server instance."""

    def __init__(self, config: RuntimeConfig, shm_dir: str = DEFAULT_SHM_DIR):
        stale = remove_stale_ipc_dirs()
        if stale:
            log.info("removed %d ZMQ folder(s) of servers that were killed (%s)", len(stale), ", ".join(stale[:3]))
        self.instance = uuid.uuid4().hex[:12]
        self.ipc_dir = tempfile.mkdtemp(prefix=f"unifiedserve-{self.instance}-")
        self.shm_dir = shm_dir
        self.config = replace(config, ipc_dir=self.ipc_dir, instance=self.instance)
        self.processes: dict[str, mp.Process] = {}
        self.stopping = False
        self._pools_unlinked = False
        self.cuda_pools = None  # CudaPoolOwner on CUDA

    def create_pools(self) -> None:
        """Allocate the shared pools: KV cache (core, decode) and patch buffer (vision, core).

        CPU: files in the tmpfs folder. CUDA: this process owns the allocations (it starts before
        and stops after every worker) and hands out IPC handles; workers see the GPU as cuda:0.
        """
        from unifiedserve.engine.llm import DTYPES

        cfg = self.config
        shapes = cfg.pool_shapes

        def dtype_of(name: str) -> torch.dtype:
            return torch.uint8 if name in BYTE_POOLS else DTYPES[cfg.engine.dtype]

        if cfg.engine.device != "cpu":
            from unifiedserve.runtime.cuda_pools import CudaPoolOwner

            self.cuda_pools = CudaPoolOwner()
            for name, shape in shapes.items():
                spec = self.cuda_pools.create(name, shape, dtype_of(name), cfg.gpu)
                cfg.pools[name] = replace(spec, cuda_device=0)
            log.info("CUDA pools on GPU %d: %.2f GiB (%s)", cfg.gpu, self.cuda_pools.num_bytes / GiB,
                     ", ".join(f"{n} {cfg.pools[n].num_bytes / GiB:.2f}" for n in shapes))
            return
        check_shm_space(self.shm_dir, sum(torch.Size(s).numel() * dtype_of(n).itemsize for n, s in shapes.items()))
        prefix = f"unifiedserve-{self.instance}"
        for name, shape in shapes.items():
            cfg.pools[name] = create_cpu_pool(self.shm_dir, prefix, name, shape, dtype_of(name))

    def start(self) -> None:
        from unifiedserve.runtime.worker import worker_main

        ctx = mp.get_context("spawn")
        classes = _worker_classes()
        for name in self.config.processes:
            cls = classes[name]
            proc = ctx.Process(target=worker_main, args=(cls, self.config), name=f"unifiedserve-{name}", daemon=False)
            proc.start()
            self.processes[name] = proc

    def all_mapped(self) -> None:
        """Every worker is up: drop the pool files (the memory lives while any process maps it)."""
        if not self._pools_unlinked:
            for spec in self.config.pools.values():
                unlink_pool(spec)
            self._pools_unlinked = True

    def dead_workers(self) -> dict[str, int]:
        return {name: p.exitcode for name, p in self.processes.items() if p.exitcode is not None}

    def stop(self, timeout: float = 5.0) -> None:
        """Shut every worker down (asking first), then remove pools and sockets. Safe to call twice."""
        self.stopping = True
        alive = [p for p in self.processes.values() if p.is_alive()]
        if alive:
            ctx = zmq.Context()
            try:
                for name in self.config.processes:
                    proc = self.processes.get(name)
                    if proc is not None and proc.is_alive():
                        sock = ctx.socket(zmq.PUSH)
                        sock.setsockopt(zmq.LINGER, 500)
                        sock.connect(self.config.address(name))
                        sock.send(protocol.encode(protocol.Shutdown()))
                        sock.close()
            finally:
                ctx.term()
            deadline = time.monotonic() + timeout
            for proc in alive:
                proc.join(max(0.0, deadline - time.monotonic()))
            for proc in alive:
                if proc.is_alive():
                    log.warning("%s did not stop in %.0f s; terminating it", proc.name, timeout)
                    proc.terminate()
                    proc.join(2.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(2.0)
        for spec in self.config.pools.values():
            unlink_pool(spec)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        if self.cuda_pools is not None:  # only once no worker can still map them
            still = [name for name, p in self.processes.items() if p.is_alive()]
            if still:
                log.error("not freeing the CUDA pools: %s still alive", ", ".join(still))
            else:
                try:
                    self.cuda_pools.free_all()
                except RuntimeError as e:  # e.g. after a fatal fault under MPS, which reaches every client
                    log.error("could not free the CUDA pools (%s); they go with this process", e)
