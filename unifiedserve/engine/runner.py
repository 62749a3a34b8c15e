"""The model runner: owns the model and every device tensor (KV cache, patch and visual-token buffers)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from unifiedserve.attention import AttentionMetadata, KVCache, get_attention_backend
from unifiedserve.engine.inputs import MediaGrid, VisionInput
from unifiedserve.engine.request import Request
from unifiedserve.engine.scheduler import SchedulerOutput
from unifiedserve.memory.buffers import PagedBuffer
from unifiedserve.model.rope import decode_positions, get_rope_index


@dataclass
class _RequestTensors:
    prompt_ids: torch.Tensor  # int64 [L]
    positions: torch.Tensor  # int64 [3, L] M-RoPE positions of the prompt
    mrope_delta: int  # decode position of output token i is L + delta + i on all three axes
    patches: torch.Tensor | None  # [P, patch_dim] until written into the patch buffer
    grids: list[tuple[int, int, int]]  # encode items' grids, in encode order
    block_table: list[int] | None = None  # KV blocks, set at admission


class ModelRunner:
    """Executes :class:`SchedulerOutput` steps on one device.

    Args:
        model: a loaded :class:`unifiedserve.model.Qwen2_5_VL`.
        num_kv_blocks, block_size: KV cache size.
        num_patch_pages, num_visual_pages, page_size: embedding buffer sizes.
        kv_storage, patch_storage: existing tensors to use as the KV cache and the patch buffer
            (shared with other processes); allocated here when ``None``.
    """

    def __init__(self, model, *, num_kv_blocks: int, block_size: int, num_patch_pages: int,
                 num_visual_pages: int, page_size: int, device: str = "cpu",
                 kv_storage: torch.Tensor | None = None, patch_storage: torch.Tensor | None = None):
        self.model = model
        cfg = model.config
        text = cfg.text
        dtype = next(model.parameters()).dtype
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        head_dim = text.head_dim
        self.kv_cache = KVCache(text.num_hidden_layers, num_kv_blocks, block_size, text.num_key_value_heads,
                                head_dim, dtype=dtype, device=device, storage=kv_storage)
        self.attn = get_attention_backend(device)(self.kv_cache, text.num_attention_heads,
                                                  text.num_key_value_heads, head_dim)
        patch_dim = 3 * cfg.vision.temporal_patch_size * cfg.vision.patch_size ** 2
        self.patch_buffer = PagedBuffer(num_patch_pages, page_size, patch_dim, dtype=dtype, device=device,
                                        storage=patch_storage)
        self.visual_buffer = PagedBuffer(num_visual_pages, page_size, cfg.vision.out_hidden_size, dtype=dtype,
                                         device=device)
        self._tensors: dict[str, _RequestTensors] = {}
        self.last_encode_s = 0.0  # wall time of the last step's vision encode (stage metrics)

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
        patches = torch.cat(pixels).to(self.dtype) if pixels else None
        self._tensors[request.request_id] = _RequestTensors(
            torch.tensor(request.prompt_token_ids, dtype=torch.int64), positions, delta, patches,
            [item.grid_thw for item in request.encode_items])

    def release(self, request_id: str) -> None:
        self._tensors.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, requests: dict[str, Request]) -> dict[str, torch.Tensor]:
        """Run one step; returns the logits ``[vocab]`` of each request that samples a token now."""
        rows = [self._tensors[r].patches for r in out.admitted if self._tensors[r].patches is not None]
        if rows:
            self.patch_buffer.write(torch.cat(rows), out.patch_write)  # [P, patch_dim]
        for r in out.admitted:
            self._tensors[r].patches = None  # now only in the patch buffer
        for r, table in out.block_tables.items():
            self._tensors[r].block_table = table
        self.last_encode_s = 0.0
        if out.encode:
            start = time.perf_counter()
            patches = self.patch_buffer.read(out.patch_read)  # [P, patch_dim]
            grids = [self._tensors[w.request_id].grids[w.item_index] for w in out.encode]
            visual = self.model.encode_vision(patches, grids)  # [P / merge^2, hidden]
            self.visual_buffer.write(visual, out.visual_write)
            self.last_encode_s = time.perf_counter() - start
        if not (out.prefill or out.decode):
            return {}
        return self._forward(out, requests)

    def _forward(self, out: SchedulerOutput, requests: dict[str, Request]) -> dict[str, torch.Tensor]:
        ids, positions, seqs, sample_rows, sample_ids = [], [], [], [], []
        visual = self.visual_buffer.read(out.visual_read) if out.visual_read is not None else None
        num_rows = 0
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
        for rid in out.decode:
            req, t = requests[rid], self._tensors[rid]
            num_done = req.prompt_len + len(req.output_token_ids) - 1  # tokens already in the cache
            ids.append(torch.tensor(req.output_token_ids[-1:], dtype=torch.int64))
            positions.append(decode_positions(num_done, t.mrope_delta))  # [3, 1]
            seqs.append((num_done, 1, self._blocks(req)))
            num_rows += 1
            sample_rows.append(num_rows - 1)
            sample_ids.append(rid)
        input_ids = torch.cat(ids)
        cfg = self.model.config
        visual_mask = (input_ids == cfg.image_token_id) | (input_ids == cfg.video_token_id)
        visual_mask[num_rows - len(out.decode):] = False  # generated tokens are text, whatever their id
        logits = forward_tokens(self.model, self.attn, self.block_size, input_ids, torch.cat(positions, dim=1),
                                seqs, visual, sample_rows, visual_mask)
        return dict(zip(sample_ids, logits))

    def _blocks(self, req: Request) -> list[int]:
        return self._tensors[req.request_id].block_table

    def mrope_delta(self, request_id: str) -> int:
        return self._tensors[request_id].mrope_delta


def forward_tokens(model, attn, block_size: int, input_ids: torch.Tensor, positions: torch.Tensor,
                   seqs: list[tuple[int, int, list[int]]], visual: torch.Tensor | None,
                   sample_rows: list[int], visual_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One LLM forward over a flattened batch; returns the logits ``[S, vocab]`` of ``sample_rows``.

    Args:
        input_ids: int64 [N]; positions: int64 [3, N] (M-RoPE).
        seqs: ``(tokens already cached, new tokens, KV block table)`` per sequence, in row order.
        visual: visual-token embeddings for the image/video placeholders among ``input_ids``, in order.
        visual_mask: bool [N], rows that take ``visual`` (default: rows with a placeholder id).
    """
    embeds = model.embed(input_ids, visual, visual_mask)  # [N, hidden]
    attn.begin(AttentionMetadata.build(seqs, block_size))
    hidden = model(embeds, positions, attn)  # [N, hidden]
    return model.compute_logits(hidden[sample_rows])  # [S, vocab]
