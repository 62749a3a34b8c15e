"""The in-process engine: ``LLM(model).generate(requests)`` or ``add_request`` + ``step()``.

A step is the engine core's (``engine/core.py``: schedule -> run the model -> sample, stop checks),
then detokenization and stop strings here.
"""

from __future__ import annotations

import hashlib
import itertools
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from unifiedserve.engine.config import EngineConfig
from unifiedserve.engine.device import DTYPES
from unifiedserve.engine.inputs import VisionInput, make_request
from unifiedserve.engine.output import TextOutput, text_output
from unifiedserve.engine.request import Request
from unifiedserve.engine.runner import ModelRunner
from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.core import EngineCore, SampledToken, SequenceState
from unifiedserve.engine.sampling import SamplerState, TokenLogprobs
from unifiedserve.engine.structured import grammar_for
from unifiedserve.engine.scheduler import Scheduler
from unifiedserve.memory.block_manager import BlockManager
from unifiedserve.memory.pages import PageAllocator

__all__ = ["DTYPES", "EngineConfig", "LLM", "RequestOutput"]

@dataclass
class RequestOutput:
    """Progress of one request after a step. ``new_token_ids``/``new_text`` are this step's delta.

    ``token_ids`` and ``logprobs`` are the output so far, copied when read: a step makes an output for every
    request that got a token, and copying each request's whole output into it then made a long generation's
    host time grow with its length (at 64 requests x 1,900 tokens, 0.3 ms of a step on a CPU core).
    """

    request_id: str
    prompt_len: int
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    #: "stop" | "length" | "abort" | "error" (the response_format's schema allowed no next token: see ``error``)
    finish_reason: str | None = None
    _tokens: list[int] = field(default_factory=list, repr=False)  # the request's own list; only ever appended to
    _logprobs: list[TokenLogprobs] | None = field(default=None, repr=False)  # likewise, when asked for
    _count: int = field(default=0, repr=False)  # tokens output when this was made
    error: str | None = None  # why the request ended with "error"

    @property
    def token_ids(self) -> list[int]:
        """Every token generated so far (a copy)."""
        return self._tokens[:self._count]

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        """Per output token (parallel to ``token_ids``) when the request asked for ``logprobs``, else None."""
        return None if self._logprobs is None else self._logprobs[:self._count]


@dataclass
class _Live:
    request: Request
    output: TextOutput
    logprobs: list[TokenLogprobs] = field(default_factory=list)


#: id(patches tensor) -> (a weak reference to it, its version counter, its grid and dtype, key): a chat's later
#: turns pass the same VisionInput again, and hashing a minute of video's patches costs a third of a second
#: on a CPU core. (Keyed by id: tensors compare elementwise, so they cannot be dictionary keys themselves.)
_CONTENT_KEYS: dict[int, tuple] = {}


def _content_key(vision: VisionInput) -> str:
    """The media key of decoded media: a digest of its patches, grid and temporal spacing (in-process,
    the pixels are all there is to know it by).

    Computed once per patches tensor and kept while the tensor lives; an in-place write to the tensor
    (or any view of it) bumps its version counter, and the key is computed again."""
    patches = vision.patches
    meta = repr((vision.kind, tuple(vision.grid_thw), vision.second_per_grid_t, str(patches.dtype)))
    known = _CONTENT_KEYS.get(id(patches))
    if known is not None and known[0]() is patches and known[1:3] == (patches._version, meta):
        return known[3]
    h = hashlib.blake2b(digest_size=16)
    h.update(meta.encode())
    if patches.numel():  # the bytes as they are (no copy for a contiguous CPU tensor)
        h.update(memoryview(patches.detach().contiguous().cpu().view(torch.uint8).numpy()).cast("B"))
    key = h.hexdigest()
    ident = id(patches)
    _CONTENT_KEYS[ident] = (weakref.ref(patches, lambda _, i=ident: _CONTENT_KEYS.pop(i, None)),
                            patches._version, meta, key)
    return key


class LLM:
    """Qwen2.5-VL with paged KV cache, chunked vision encode, chunked prefill and batched decode.

    Args:
        model: checkpoint directory (HF format). ``None``: the demo model (written on first use).
        config: pools, budgets, device, dtype (default ``EngineConfig()``: the CPU, float32).

    On CUDA the start-up also sizes the KV pool (unless ``num_kv_blocks`` is given), warms the
    attention kernels, and captures the decode CUDA graphs (unless ``enforce_eager``), so none of
    that lands on a request's path.
    """

    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None):
        from unifiedserve.model.demo import DEFAULT_DEMO_PATH, write_demo_model
        from unifiedserve.model.loader import load_model
        from unifiedserve.model.processor import load_processor

        if model is None:
            model = Path(DEFAULT_DEMO_PATH).expanduser()  # unexpanded, "~" named a folder in the working directory
            if not (model / "config.json").exists():
                write_demo_model(model)
        config = config if config is not None else EngineConfig()
        self.model, self.model_config = load_model(model, DTYPES[config.dtype], config.device)
        self.model.eval()
        self.processor = load_processor(model)
        self.model_dir = Path(model)  # response_format grammars read its tokenizer
        self.kv_sizing = None
        if config.num_kv_blocks is None:  # CUDA: from gpu_memory_utilization
            from unifiedserve.engine.profile import profile_kv_sizing

            self.kv_sizing = profile_kv_sizing(self.model, config)
            config = replace(config, num_kv_blocks=self.kv_sizing.num_blocks)
        self.config = config
        self.runner = ModelRunner(self.model, num_kv_blocks=config.num_kv_blocks, block_size=config.block_size,
                                  num_patch_pages=config.num_patch_pages, num_visual_pages=config.num_visual_pages,
                                  page_size=config.page_size, device=config.device, attention=config.attention,
                                  media_cache_bytes=config.media_cache_bytes)
        self.runner.warmup(None if config.enforce_eager else config.max_cuda_graph_batch)
        self.scheduler = Scheduler(config.scheduler, BlockManager(config.num_kv_blocks, config.block_size,
                                                                  config.enable_prefix_caching),
                                   PageAllocator(config.num_patch_pages, config.page_size),
                                   PageAllocator(config.num_visual_pages, config.page_size), self.runner.media_cache)
        self.core = EngineCore(self.scheduler, self.runner, config.async_scheduling)
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)

    # -- building requests -------------------------------------------------------------------
    def build_prompt(self, messages: Sequence[dict]) -> tuple[list[int], list[VisionInput]]:
        """Render chat messages whose parts may hold ``{"type": "image"|"video", "vision": VisionInput}``.

        Returns the prompt token ids with placeholders expanded, and the vision inputs in prompt order.
        """
        vision: list[VisionInput] = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                for part in content:
                    if part.get("type") in ("image", "video"):
                        v = part.get("vision")
                        if not isinstance(v, VisionInput) or v.kind != part["type"]:
                            raise ValueError(f"a {part['type']} part needs 'vision': a VisionInput of that kind")
                        vision.append(v)
        ids = self.processor.tokenize(self.processor.render_chat(messages))
        return self.expand(ids, vision), vision

    def expand(self, ids: list[int], vision: list[VisionInput]) -> list[int]:
        return self.processor.expand_vision_tokens(
            ids, [v.grid_thw for v in vision if v.kind == "image"], [v.grid_thw for v in vision if v.kind == "video"])

    def add_request(self, prompt_token_ids: list[int], vision: Sequence[VisionInput] = (),
                    params: SamplingParams = SamplingParams(), request_id: str | None = None) -> str:
        """Queue a request whose image/video placeholders are already expanded (see :meth:`build_prompt`)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = make_request(request_id, prompt_token_ids, params, list(vision), self.model_config)
        stop_ids = params.stop_ids(self.eos_token_ids)
        grammar = grammar_for(params, self.model_dir, stop_ids)  # a bad schema raises before anything is queued
        if vision and (self.config.enable_prefix_caching or self.runner.media_cache is not None):
            request.media_keys = [_content_key(v) for v in vision]
        seq = SequenceState(params, SamplerState.for_params(params, self.runner.device, grammar), stop_ids,
                            request.output_token_ids)
        self.core.add(request, list(vision), seq)
        self._live[request_id] = _Live(request, text_output(self.processor, params))
        return request_id

    def abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._finish(request_id, "abort")

    # -- running -----------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run, sample. Returns outputs of requests that got tokens or finished."""
        out, sampled = self.core.step()
        if out.is_empty and self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError("no request can be admitted: the KV cache or patch buffer is too small")
        return [self._output(rid, result) for rid, result in sampled]

    def _output(self, request_id: str, result: SampledToken) -> RequestOutput:
        """Text, stop strings and the caller's view of one sampled token; frees a finished request."""
        live = self._live[request_id]
        req, token, reason = live.request, result.token_id, result.finish_reason
        if result.logprobs is not None:
            live.logprobs.append(result.logprobs)
        new_text = ""
        if result.error is None:  # a token sampled at a grammar's dead end is no output
            new_text = live.output.add(token, result.index, result.is_stop_token)
            if live.output.stopped:
                reason = "stop"
        if reason is not None:
            new_text += live.output.finish()  # what was held back as a possible stop string's start
        out = RequestOutput(request_id, req.prompt_len, live.output.text, [token] if result.error is None else [],
                            new_text, reason is not None, reason, req.output_token_ids,
                            live.logprobs if req.params.logprobs is not None else None, len(req.output_token_ids),
                            result.error)
        if reason is not None:
            self._finish(request_id, reason)
        return out

    def _finish(self, request_id: str, reason: str) -> None:
        self.core.finish(request_id, reason)
        self._live.pop(request_id)

    def generate(self, prompts: Sequence[tuple[list[int], Sequence[VisionInput], SamplingParams]]
                 ) -> list[RequestOutput]:
        """Run requests ``(prompt_token_ids, vision, params)`` to completion; outputs in input order."""
        ids = [self.add_request(p, v, s) for p, v, s in prompts]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished:
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]

    # -- pool usage (leak checks, metrics) ---------------------------------------------------------
    def pool_usage(self) -> dict[str, int]:
        s = self.scheduler
        return {"kv_blocks_used": s.blocks.num_used_blocks, "patch_pages_used": s.patch_pages.num_used_pages,
                "visual_pages_used": s.visual_pages.num_used_pages}
