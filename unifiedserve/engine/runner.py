"""The model runner: owns the model and every device tensor (KV cache, patch and visual-token buffers).

A step is built on the host (token ids, M-RoPE positions, block tables are small Python data),
copied to the device once, and run without a host sync: the attention plan is made before the
forward, the visual rows are found on the host, and the rotary tables are indexed on the device.
The only device-to-host copy of a step is the sampled token ids (:func:`~unifiedserve.engine.sampling.sample`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from unifiedserve import ops
from unifiedserve.attention import KVCache, get_attention_backend
from unifiedserve.attention.metadata import as_block_table
from unifiedserve.engine.inputs import MediaGrid, VisionInput
from unifiedserve.engine.media_cache import MediaCache
from unifiedserve.engine.request import Request
from unifiedserve.engine.runner_startup import RunnerStartup
from unifiedserve.engine.scheduler import SchedulerOutput
from unifiedserve.memory.buffers import PagedBuffer
from unifiedserve.memory.transfer import to_device
from unifiedserve.model.rope import get_rope_index

log = logging.getLogger(__name__)



class RopeTables:
    """M-RoPE ``cos``/``sin`` on the device without host syncs (what ``mrope_cos_sin`` computes).

    The frequency table and the axis of each frequency pair are built once, both already repeated for the
    two halves of the head dimension; a step only indexes them with its positions (one gather, one product
    that also converts the positions to float32, as ``mrope_cos_sin``'s ``.float()`` does: the same values
    from two kernels fewer than gather, convert, multiply and concatenate), so this also runs inside a CUDA graph.
    """

    def __init__(self, text_config, device: torch.device):
        d = text_config.head_dim
        inv_freq = 1.0 / (text_config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d))
        self.inv_freq = torch.cat((inv_freq, inv_freq))  # [D]
        axis = [a for a, n in enumerate(text_config.mrope_section) for _ in range(n)]
        self.axis = torch.tensor(axis + axis, dtype=torch.int64).to(device)  # [D]: 0..0 1..1 2..2, twice

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[3, N]`` on the device -> ``(cos, sin)``, each ``[N, head_dim]`` in ``dtype``."""
        # [N, D] float32 (int64 * float32 computes in float32), written row-major: the product of the transposed
        # gather alone would keep its column-major strides, and so would cos and sin, which the Q/K/V epilogue
        # (ops/skinny_rope.RopeWrite) needs with contiguous rows (the first H100 run with it failed there)
        emb = torch.mul(positions[self.axis].T, self.inv_freq,
                        out=torch.empty(positions.shape[1], self.inv_freq.shape[0], dtype=torch.float32,
                                        device=positions.device))
        return emb.cos().to(dtype), emb.sin().to(dtype)


def feed(ids: torch.Tensor, fed: tuple[torch.Tensor | slice, torch.Tensor]) -> None:
    """Write ``fed = (rows, tokens)`` into the device tensor ``ids`` in place: ``ids[rows] = tokens``.

    ``rows`` is an int64 ``[F]`` device tensor, or a ``slice`` when the rows are consecutive and so are the tokens
    they take (the usual async decode step: every row fed, in the order of the step before): then one device-to-device
    copy, against a copy of the indices up, a gather and a scatter (issue 13: every operation outside a decode graph's
    replay costs the device microseconds).
    """
    rows, tokens = fed
    if isinstance(rows, slice):
        ids[rows].copy_(tokens)
    else:
        ids.index_copy_(0, rows, tokens)


def consecutive(values: list[int]) -> slice | None:
    """``slice(a, a + len(values))`` when ``values`` is ``a, a + 1, ...`` (non-empty), else None."""
    if values and all(b == a + 1 for a, b in zip(values, values[1:])):
        return slice(values[0], values[-1] + 1)
    return None


def run_decoder(model, attn, input_ids: torch.Tensor, positions: torch.Tensor, rope: RopeTables,
                visual: torch.Tensor | None = None, visual_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Embed, run every layer on the planned ``attn``, final norm; all on the device, no host sync.

    Args:
        input_ids: int64 ``[N]``; positions: int64 ``[3, N]`` (both on the model's device).
        visual, visual_rows: ``[V, hidden]`` visual tokens and the int64 ``[V]`` rows they replace.

    Returns:
        ``[N, hidden]`` final hidden states.
    """
    lm = model.language_model
    x = lm.embed_tokens(input_ids)  # [N, hidden]
    if visual_rows is not None:
        x.index_copy_(0, visual_rows, visual.to(x.dtype))
    cos, sin = rope(positions, x.dtype)  # [N, D] each
    return lm.run_layers(x, cos, sin, attn)


def forward_tokens(model, attn, input_ids: torch.Tensor, positions: torch.Tensor,
                   seqs: list[tuple[int, int, list[int]]], visual: torch.Tensor | None,
                   sample_rows: list[int], visual_mask: torch.Tensor | None = None,
                   rope: RopeTables | None = None,
                   fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One LLM forward over a flattened batch; returns the logits ``[S, vocab]`` of ``sample_rows``.

    Args:
        input_ids: int64 [N] on the host; positions: int64 [3, N] on the host (M-RoPE). Both are
            copied to the model's device once.
        seqs: ``(tokens already cached, new tokens, KV block table)`` per sequence, in row order.
        visual: visual-token embeddings (on the model's device) for the image/video placeholders
            among ``input_ids``, in order.
        visual_mask: bool [N] on the host, rows that take ``visual`` (default: rows with a placeholder id).
        rope: the model's :class:`RopeTables` (built here when ``None``).
        fed: ``(rows, tokens)``, tokens int64 ``[F]`` on the model's device, rows such a tensor or a ``slice``
            (:func:`feed`): token ids that replace ``input_ids`` at those rows (text rows whose token is not on the
            host yet: async scheduling).

    Raises:
        ValueError: positions of the wrong shape, or placeholders and visual tokens differ in number.
    """
    device = model.language_model.tok_embeddings.weight.device
    n = input_ids.shape[0]
    if positions.dim() != 2 or positions.shape[0] != 3 or positions.shape[1] != n:
        raise ValueError(f"positions must be [3, {n}], got {list(positions.shape)}")
    input_ids, positions = input_ids.cpu(), positions.cpu()  # host data already: no copy
    if visual_mask is None:
        cfg = model.config
        visual_mask = (input_ids == cfg.image_token_id) | (input_ids == cfg.video_token_id)
    rows = visual_mask.cpu().nonzero().flatten()  # [V] on the host
    num_visual = 0 if visual is None else visual.shape[0]
    if rows.numel() != num_visual:
        raise ValueError(f"input_ids has {rows.numel()} image/video placeholder tokens but "
                         f"{num_visual} visual tokens were given")
    attn.plan(seqs)
    rope = rope or RopeTables(model.config.text, device)
    ids_dev = to_device(input_ids, device)
    if fed is not None:
        ids_dev = ids_dev.clone() if ids_dev is input_ids else ids_dev  # the caller's host tensor stays as it was
        feed(ids_dev, fed)
    hidden = run_decoder(model, attn, ids_dev, to_device(positions, device), rope,
                         visual if num_visual else None, to_device(rows, device) if num_visual else None)
    picked = to_device(torch.tensor(sample_rows, dtype=torch.int64), device)
    return model.compute_logits(hidden.index_select(0, picked))  # [S, vocab]


class StepLogits(Mapping):
    """A step's logits: ``rows`` ``[S, vocab]`` on the device, row ``i`` that of ``request_ids[i]``.

    Also a mapping request id -> its ``[vocab]`` row; the engine core samples ``rows`` as they are (no
    per-row views stacked again: host time per step, issue 13).
    """

    __slots__ = ("request_ids", "rows", "_index")

    def __init__(self, request_ids: list[str], rows: torch.Tensor | None):
        self.request_ids = request_ids
        self.rows = rows
        self._index = {r: i for i, r in enumerate(request_ids)}

    def __getitem__(self, request_id: str) -> torch.Tensor:
        return self.rows[self._index[request_id]]

    def __iter__(self):
        return iter(self.request_ids)

    def __len__(self) -> int:
        return len(self.request_ids)


_NO_LOGITS = StepLogits([], None)


@dataclass
class _RequestTensors:
    num_prompt_tokens: int  # L
    prompt_ids: torch.Tensor  # int64 [L] (host); empty for a request prefilled elsewhere (adopt)
    positions: torch.Tensor  # int64 [3, L] M-RoPE positions of the prompt (host); empty when adopted
    mrope_delta: int  # decode position of output token i is L + delta + i on all three axes
    patches: list[torch.Tensor] | None  # per media [P_m, patch_dim] (host) until written into the patch buffer
    grids: list[tuple[int, int, int]]  # encode items' grids, in encode order
    block_table: np.ndarray | None = None  # int32 KV block ids, set at admission
    #: media being encoded for the media cache: media index -> visual tokens of its items so far
    encoded: dict[int, list[torch.Tensor]] | None = None


class ModelRunner(RunnerStartup):
    """Executes :class:`SchedulerOutput` steps on one device (start-up: :class:`RunnerStartup`).

    Args:
        model: a loaded :class:`unifiedserve.model.Qwen2_5_VL` (its weights set the device and dtype).
        num_kv_blocks, block_size: KV cache size.
        num_patch_pages, num_visual_pages, page_size: embedding buffer sizes; 0 pages: no such
            buffer (a decode-only runner, as in the decode process, has neither).
        device: where the caches live; must be the model's device.
        kv_storage, patch_storage: existing tensors to use as the KV cache and the patch buffer
            (shared with other processes); allocated here when ``None``.
        attention: attention backend name (``auto``, ``flashinfer``, ``torch``).
        media_cache_bytes: bound of the media cache (encoded visual tokens by media key, on
            ``device``); 0 turns it off.

    Raises:
        ValueError: the model's weights are on another device, or a bad backend name.
    """

    def __init__(self, model, *, num_kv_blocks: int, block_size: int, num_patch_pages: int,
                 num_visual_pages: int, page_size: int, device: str = "cpu",
                 kv_storage: torch.Tensor | None = None, patch_storage: torch.Tensor | None = None,
                 attention: str = "auto", media_cache_bytes: int = 0):
        self.model = model
        cfg = model.config
        text = cfg.text
        weight = next(model.language_model.parameters())  # the vision tower may be left unloaded (decode)
        self.dtype = weight.dtype
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if weight.device != self.device:
            raise ValueError(f"the model's weights are on {weight.device}, the runner's device is {self.device}")
        self.block_size = block_size
        head_dim = text.head_dim
        self.kv_cache = KVCache(text.num_hidden_layers, num_kv_blocks, block_size, text.num_key_value_heads,
                                head_dim, dtype=self.dtype, device=self.device, storage=kv_storage)
        backend = get_attention_backend(self.device, attention, dtype=self.kv_cache.dtype, head_dim=head_dim)
        self.attn = backend(self.kv_cache, text.num_attention_heads, text.num_key_value_heads, head_dim)
        self.rope = RopeTables(text, self.device)
        patch_dim = 3 * cfg.vision.temporal_patch_size * cfg.vision.patch_size ** 2
        self.patch_buffer = PagedBuffer(num_patch_pages, page_size, patch_dim, dtype=self.dtype, device=self.device,
                                        storage=patch_storage) if num_patch_pages else None
        self.visual_buffer = PagedBuffer(num_visual_pages, page_size, cfg.vision.out_hidden_size, dtype=self.dtype,
                                         device=self.device) if num_visual_pages else None
        self.media_cache = MediaCache(media_cache_bytes) if media_cache_bytes > 0 else None
        self.graphs = None  # DecodeGraphs once captured
        self.decode_attention_tuning: list = []  # what tune_decode_attention measured (bench_engine prints it)
        # build or load csrc/ now (the fused layer ops run in every forward): a first build takes seconds on
        # the CPU and about a minute with nvcc, which belongs to start-up, not to a request or a graph capture
        native = ops.native_available()
        if self.device.type == "cuda" and native and not ops.build_info().get("cuda"):
            log.warning("unifiedserve.ops has no CUDA kernels (%s): the fused layer ops run as torch ops on %s",
                        ops.build_info().get("cuda_reason"), self.device)
        self._tensors: dict[str, _RequestTensors] = {}
        self._encode_s = 0.0
        self._encode_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    @property
    def last_encode_s(self) -> float:
        """Wall time of the last step's vision encode (stage metrics); 0 when it encoded nothing.

        On CUDA it is read from events, after the step's token copy has already waited for them.
        """
        if self._encode_events is not None:
            start, end = self._encode_events
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return self._encode_s

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: Request, vision: list[VisionInput] | list[MediaGrid]) -> None:
        """Compute positions, and hold the request's patches (if given) until the scheduler admits it.

        With :class:`MediaGrid` entries (no pixels) another process writes the patch buffer.
        """
        cfg = self.model.config
        images = [v.grid_thw for v in vision if v.kind == "image"]
        videos = [v for v in vision if v.kind == "video"]
        positions, delta = get_rope_index(request.prompt_token_ids, images, [v.grid_thw for v in videos],
                                          [v.second_per_grid_t for v in videos], cfg)
        pixels = [v.patches for v in vision if isinstance(v, VisionInput)]
        self._tensors[request.request_id] = _RequestTensors(
            request.prompt_len, torch.tensor(request.prompt_token_ids, dtype=torch.int64), positions, delta,
            pixels or None, [item.grid_thw for item in request.encode_items])

    def adopt(self, request_id: str, num_prompt_tokens: int, mrope_delta: int, block_table: list[int]) -> None:
        """Decode a request whose prompt was prefilled elsewhere into ``block_table`` of this KV cache
        (shared with the runner that prefilled it); only its decode rows run here."""
        self._tensors[request_id] = _RequestTensors(
            num_prompt_tokens, torch.empty(0, dtype=torch.int64), torch.empty(3, 0, dtype=torch.int64), mrope_delta,
            None, [], as_block_table(block_table))

    def release(self, request_id: str) -> None:
        self._tensors.pop(request_id, None)

    # -- steps ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, requests: dict[str, Request], pending=None) -> StepLogits:
        """Run one step; returns the logits (on the device) of the requests that sample now.

        ``pending`` (an :class:`~unifiedserve.engine.core.PendingStep`, async scheduling): a decode row of a
        request in it feeds that step's sampled token, still on the device, which its output list does not
        hold yet.
        """
        rows = []  # admitted requests' patches, without the media the caches hold
        for r in out.admitted:
            media = self._tensors[r].patches or []
            skip = set(out.skip_media.get(r, ()))
            rows.extend(p for m, p in enumerate(media) if m not in skip)
            self._tensors[r].patches = None  # now only in the patch buffer
        if rows:
            # [P, patch_dim]
            self.patch_buffer.write(to_device(torch.cat(rows).to(self.dtype), self.device), out.patch_write)
        for r, table in out.block_tables.items():  # int32 once, sliced at every step (attention.metadata)
            self._tensors[r].block_table = as_block_table(table)
        self._encode_s, self._encode_events = 0.0, None
        if out.encode:
            events = None
            if self.device.type == "cuda":
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
            start = time.perf_counter()
            self.visual_buffer.write(self._encode(out.encode, out.patch_read, requests), out.visual_write)
            if events is not None:
                events[1].record()
                self._encode_events = events
            self._encode_s = time.perf_counter() - start
        if not (out.prefill or out.decode):
            return _NO_LOGITS
        return self._forward(out, requests, pending)

    def _encode(self, works, patch_read, requests: dict[str, Request]) -> torch.Tensor:
        """Visual tokens of the step's encode items, in order: the encoder's for patches, the media
        cache's for ``from_cache`` items; each media encoded whole is offered to the media cache."""
        encoded = [w for w in works if not w.from_cache]
        pieces = []
        if encoded:
            patches = self.patch_buffer.read(patch_read)  # [P, patch_dim]
            grids = [self._tensors[w.request_id].grids[w.item_index] for w in encoded]
            visual = self.model.encode_vision(patches, grids)  # [P / merge^2, hidden]
            pieces = list(visual.split([requests[w.request_id].encode_items[w.item_index].num_visual_tokens
                                        for w in encoded]))
        out, new = [], iter(pieces)
        for w in works:
            req = requests[w.request_id]
            media = req.encode_items[w.item_index].media_index
            if w.from_cache:
                start, end = req.item_visual_range(w.item_index)
                out.append(self.media_cache.get(req.media_keys[media])[start + w.skip_visual:end])
                continue
            piece = next(new)
            out.append(piece)
            if self.media_cache is not None and req.media_keys and req.media_keys[media] \
                    and self._fits_media_cache(req, media, piece):
                t = self._tensors[w.request_id]
                t.encoded = t.encoded if t.encoded is not None else {}
                # a copy: a view would keep the step's whole encoder output alive until the media's last item
                t.encoded.setdefault(media, []).append(piece.clone())
                if req.is_last_item_of_media(w.item_index):
                    self.media_cache.put(req.media_keys[media], torch.cat(t.encoded.pop(media)))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _fits_media_cache(self, req: Request, media: int, piece: torch.Tensor) -> bool:
        """Whether media ``media`` of ``req``, encoded whole, is within the media cache's capacity: one that is
        not would be refused at its last item, and its pieces, kept until then, would be memory past the bound
        (a long video's visual tokens, per request encoding it)."""
        rows = sum(item.num_visual_tokens for item in req.encode_items if item.media_index == media)
        return rows * piece.shape[-1] * piece.element_size() <= self.media_cache.capacity_bytes

    def _forward(self, out: SchedulerOutput, requests: dict[str, Request], pending=None) -> StepLogits:
        ids, positions, seqs, sample_rows, sample_ids = [], [], [], [], []
        num_rows = 0
        waiting_rows = pending.rows if pending is not None else {}
        from_device = ([], [])  # (row in this step, row in the pending step) of tokens fed from the device
        for chunk in out.prefill:
            t = self._tensors[chunk.request_id]
            end = chunk.start + chunk.num_tokens
            ids.append(t.prompt_ids[chunk.start:end])
            positions.append(t.positions[:, chunk.start:end])
            seqs.append((chunk.start, chunk.num_tokens, self._blocks(requests[chunk.request_id])))
            num_rows += chunk.num_tokens
            if chunk.is_last:
                sample_rows.append(num_rows - 1)
                sample_ids.append(chunk.request_id)
        if out.decode:  # one row per request: its last token, fed at the position after its cached tokens
            last, at = [], []
            for rid in out.decode:
                req, t = requests[rid], self._tensors[rid]
                behind = rid in waiting_rows  # its newest token is the pending step's, not in its list yet
                if behind:
                    from_device[0].append(num_rows)
                    from_device[1].append(waiting_rows[rid])
                # prompt + outputs but the last are cached; a generated token's M-RoPE position is the same on
                # all three axes (rope.decode_positions): num_cached + delta
                num_cached = t.num_prompt_tokens + len(req.output_token_ids) - 1 + behind
                last.append(0 if behind else req.output_token_ids[-1])
                at.append(num_cached + t.mrope_delta)
                seqs.append((num_cached, 1, t.block_table))
                sample_rows.append(num_rows)
                sample_ids.append(rid)
                num_rows += 1
            # two host tensors for the whole batch, not two per row (host time per step, issue 13)
            ids.append(torch.tensor(last, dtype=torch.int64))  # [D]
            positions.append(torch.tensor(at, dtype=torch.int64).expand(3, -1))  # [3, D]
        input_ids = torch.cat(ids) if len(ids) > 1 else ids[0]  # [N] (host)
        positions = torch.cat(positions, dim=1) if len(positions) > 1 else positions[0]  # [3, N] (host)
        fed = None
        if from_device[0]:  # rows whose token is on the device: (rows, tokens [F]) to write after the copy
            dst, src = (consecutive(rows) for rows in from_device)
            if dst is not None and src is not None:  # the usual step: no index to send up (feed)
                fed = (dst, pending.tokens[src])
            else:
                index = to_device(torch.tensor(from_device, dtype=torch.int64), self.device)  # [2, F]: one copy
                fed = (index[0], pending.tokens[index[1]])
        if not out.prefill and self.graphs is not None and self.graphs.serves(seqs):
            # [N, vocab]: decode rows are the samples; a view of the graph's output, sampled before the next step
            logits = self.graphs.run(seqs, input_ids, positions, fed, copy=False)
        else:
            visual = self.visual_buffer.read(out.visual_read) if out.visual_read is not None else None
            cfg = self.model.config
            visual_mask = (input_ids == cfg.image_token_id) | (input_ids == cfg.video_token_id)
            visual_mask[num_rows - len(out.decode):] = False  # generated tokens are text, whatever their id
            logits = forward_tokens(self.model, self.attn, input_ids, positions, seqs, visual, sample_rows,
                                    visual_mask, self.rope, fed)
        return StepLogits(sample_ids, logits)

    def _blocks(self, req: Request) -> np.ndarray:
        return self._tensors[req.request_id].block_table

    def block_table(self, request_id: str) -> list[int]:
        """The request's KV block table (prompt + max_tokens), set when its prefill started."""
        return self._tensors[request_id].block_table.tolist()

    def mrope_delta(self, request_id: str) -> int:
        return self._tensors[request_id].mrope_delta
