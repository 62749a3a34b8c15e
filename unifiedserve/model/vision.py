"""The Qwen2.5-VL vision tower: patch tokens in, visual tokens out.

Pipeline for ``patches [N, 1176]`` (rows ordered frame pair -> 2x2 merge group -> row-major, as
:func:`flashcodec.patches.frames_to_patches` writes them):

1. patch embedding: one Linear over the 1176-wide rows (the checkpoint's Conv3d, whose kernel
   equals its stride, flattened to a matrix);
2. **window reordering**: whole merge groups (4 patches) are permuted so that the groups of each
   attention window (``window_size`` px = 4x4 groups) are contiguous; the 2-D rotary tables are
   permuted the same way;
3. ``depth`` pre-norm blocks; blocks in ``fullatt_block_indexes`` attend over the whole frame pair,
   the others inside their window;
4. the merger (RMSNorm, 4 patches concatenated, MLP) makes one visual token per merge group;
5. the **inverse permutation** puts visual tokens back in row-major order.

Attention never crosses a frame pair (a temporal slice ``t`` of a grid), so encoding the slices
of a video one at a time gives the same visual tokens as encoding the whole video.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from unifiedserve.attention.varlen import (check_varlen_impl, default_varlen_impl, fused_varlen_attention,
                                           resolve_varlen_impl)
from unifiedserve.model.config import VisionConfig
from unifiedserve import ops
from unifiedserve.memory.transfer import to_device
from unifiedserve.model.llm import MLP, RMSNorm

__all__ = ["MLP_MULTIPLE", "VisionLayout", "VisionTower", "vision_layout"]

Grid = tuple[int, int, int]
#: the vision MLP's intermediate width is padded to a multiple of this on CUDA (VisionTower.align_mlp):
#: Qwen2.5-VL's 3420 becomes 3456 = 27 x 128.
MLP_MULTIPLE = 64


@dataclass(frozen=True)
class VisionLayout:
    """Index bookkeeping for one call of the tower (CPU tensors, cached per grid list)."""

    #: int64 [N / merge_unit]: merge group at each position of the window order.
    window_index: torch.Tensor
    #: int64 [N / merge_unit]: inverse of ``window_index`` (visual token order restored).
    reverse_index: torch.Tensor
    #: int64 [N, 2]: (row, column) of each patch inside its frame, in window order.
    patch_hw: torch.Tensor
    #: patches per attention window, in window order (window-attention blocks).
    window_lens: tuple[int, ...]
    #: patches per frame pair, in order (full-attention blocks).
    frame_lens: tuple[int, ...]


@functools.lru_cache(maxsize=256)
def vision_layout(grid_thw: tuple[Grid, ...], merge_size: int, window_units: int) -> VisionLayout:
    """Window order, its inverse, rotary coordinates and attention segments for a list of grids.

    Windows tile each frame's ``(h/m) x (w/m)`` grid of merge groups from the top-left with
    ``window_units x window_units`` tiles (the last row/column of tiles may be partial); windows
    are ordered row-major per frame, and groups row-major inside a window.
    """
    m = merge_size
    window_index, window_lens, frame_lens, hw = [], [], [], []
    offset = 0  # merge groups before this frame
    for t, h, w in grid_thw:
        gh, gw = h // m, w // m
        # Rotary coordinates of the patches of one frame, in patch order (group-major).
        rows = torch.arange(h).view(gh, m, 1, 1).expand(gh, m, gw, m)  # [gh, m, gw, m]
        cols = torch.arange(w).view(1, 1, gw, m).expand(gh, m, gw, m)
        frame_hw = torch.stack([rows, cols], dim=-1).permute(0, 2, 1, 3, 4).reshape(gh * gw, m * m, 2)
        # Merge groups of one frame in window order, and the window lengths (in patches).
        groups = torch.arange(gh * gw).view(gh, gw)
        order, lens = [], []
        for r0 in range(0, gh, window_units):
            for c0 in range(0, gw, window_units):
                tile = groups[r0:r0 + window_units, c0:c0 + window_units].reshape(-1)
                order.append(tile)
                lens.append(tile.numel() * m * m)
        order = torch.cat(order)  # [gh * gw]
        for _ in range(t):
            window_index.append(order + offset)
            hw.append(frame_hw[order])  # [gh * gw, m*m, 2]
            offset += gh * gw
            window_lens.extend(lens)
            frame_lens.append(h * w)
    window_index = torch.cat(window_index)
    return VisionLayout(
        window_index=window_index,
        reverse_index=torch.argsort(window_index),
        patch_hw=torch.cat(hw).reshape(-1, 2),
        window_lens=tuple(window_lens),
        frame_lens=tuple(frame_lens),
    )


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int],
                     scale: float, impl: str = "grouped") -> torch.Tensor:
    """Bidirectional attention inside consecutive segments of the rows.

    ``grouped`` (here): segments of equal length are batched into one SDPA call (all full windows
    of a frame share a length), so a frame costs a handful of calls rather than one per window.
    The fused implementations are in :mod:`unifiedserve.attention.varlen`.

    Args:
        q, k, v: ``[N, H, D]``; ``seq_lens`` sums to ``N``.
        impl: one of :data:`unifiedserve.attention.varlen.VARLEN_IMPLS`.
    Returns:
        ``[N, H, D]``.
    """
    impl = resolve_varlen_impl(impl, q.device, q.dtype)
    if impl != "grouped":
        return fused_varlen_attention(q, k, v, seq_lens, scale, impl)
    n, h, d = q.shape
    out = torch.empty_like(q)
    starts: dict[int, list[int]] = {}
    start = 0
    for length in seq_lens:
        starts.setdefault(length, []).append(start)
        start += length
    assert start == n, f"segments cover {start} rows, expected {n}"
    for length, first_rows in starts.items():
        if len(first_rows) == 1:
            rows = slice(first_rows[0], first_rows[0] + length)
        else:
            rows = (torch.tensor(first_rows, device=q.device)[:, None]
                    + torch.arange(length, device=q.device)).reshape(-1)  # [S * L]
        qs, ks, vs = (x[rows].view(-1, length, h, d).transpose(1, 2) for x in (q, k, v))  # [S, H, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [S, H, L, D]
        out[rows] = o.transpose(1, 2).reshape(-1, h, d)
    return out


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.attention_impl = default_varlen_impl()  # "auto" unless the environment names one; see set_attention_impl

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, D] each
        # Rotary in float32 (cos/sin are float32 [N, D]), as the reference does, then back to the model
        # dtype; one fused pass over q and k in place when the native ops are built.
        q, k = ops.rotary(q, k, cos, sin)
        out = varlen_attention(q, k, v, seq_lens, self.head_dim ** -0.5, self.attention_impl)  # [N, H, D]
        return self.proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.norm2 = RMSNorm(config.hidden_size, eps=1e-6)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=True)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                seq_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One block on the split residual stream: the stream is ``residual + x`` (``x`` alone for the first
        block, ``residual=None``), each ``[N, hidden]``. Returns the MLP's output and the stream before it, so
        that both residual adds are fused into the RMSNorm that follows them (``norm2``, then the next block's
        ``norm1`` or the merger's norm), as in the language model. The inputs' memory is reused (the fused adds
        write in place): pass tensors nobody reads afterwards."""
        if residual is None:
            residual, h = x, self.norm1(x)
        else:
            h, residual = self.norm1.add(x, residual)  # residual += x
        normed, residual = self.norm2.add(self.attn(h, cos, sin, seq_lens), residual)  # residual += attn(...)
        return self.mlp(normed), residual


class PatchMerger(nn.Module):
    """RMSNorm per patch, then each merge group's patches concatenated and projected by an MLP."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.merged_dim = config.hidden_size * config.merge_unit
        self.norm = RMSNorm(config.hidden_size, eps=1e-6)
        self.fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.fc2 = nn.Linear(self.merged_dim, config.out_hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, hidden]`` patches (the stream ``residual + x`` when ``residual`` is given, the add fused into
        the norm) -> ``[N / 4, out_hidden]``."""
        x = self.norm(x) if residual is None else self.norm.add(x, residual)[0]
        x = x.view(-1, self.merged_dim)  # [N / 4, 4 * hidden]
        return self.fc2(F.gelu(self.fc1(x)))  # [N / 4, out_hidden]


class VisionTower(nn.Module):
    """Patch tokens -> visual tokens. See the module docstring for the pipeline."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.patch_dim, config.hidden_size, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, patches: torch.Tensor, grid_thw: Sequence[Grid]) -> torch.Tensor:
        """Encode images and videos.

        Args:
            patches: ``[N, patch_dim]`` rows of all media, concatenated in ``grid_thw`` order.
            grid_thw: ``(t, h, w)`` patch grid per image or video; ``N = sum(t * h * w)``.
        Returns:
            ``[N / merge_unit, out_hidden_size]`` visual tokens, media after media, each in
            row-major order of merge groups (the order of its placeholder tokens).
        Raises:
            ValueError: the grids do not describe ``patches`` or are not multiples of the merge size.
        """
        cfg = self.config
        grids = _check_grids(grid_thw, cfg.spatial_merge_size)
        if patches.dim() != 2 or patches.shape[1] != cfg.patch_dim:
            raise ValueError(f"patches must be [N, {cfg.patch_dim}], got {list(patches.shape)}")
        if patches.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"patches has {patches.shape[0]} rows but grid_thw {list(grids)} needs "
                             f"{sum(t * h * w for t, h, w in grids)}")
        layout = vision_layout(grids, cfg.spatial_merge_size, cfg.window_merge_units)
        device, dtype = patches.device, self.patch_embed.weight.dtype
        unit = cfg.merge_unit

        x = self.patch_embed(patches.to(dtype))  # [N, hidden]
        window_index = to_device(layout.window_index, device)  # queued: no host sync
        x = x.view(-1, unit, cfg.hidden_size)[window_index].view(-1, cfg.hidden_size)  # [N, hidden], window order
        cos, sin = self._rotary(to_device(layout.patch_hw, device))  # [N, head_dim] float32, window order

        residual = None  # the stream is residual + x; each add is fused into the norm after it
        for i, block in enumerate(self.blocks):
            seq_lens = layout.frame_lens if i in cfg.fullatt_block_indexes else layout.window_lens
            x, residual = block(x, residual, cos, sin, seq_lens)  # [N, hidden] each

        tokens = self.merger(x, residual)  # [N / 4, out_hidden], window order
        return tokens[to_device(layout.reverse_index, device)]  # [N / 4, out_hidden], row-major per frame

    def align_mlp(self, multiple: int = MLP_MULTIPLE) -> int:
        """Zero-pad every block's MLP to an intermediate width that is a multiple of ``multiple``
        (:meth:`unifiedserve.model.llm.MLP.pad_intermediate`): same outputs, aligned GEMMs.
        ``config.intermediate_size`` keeps the checkpoint's width. Returns the width now used."""
        return min((block.mlp.pad_intermediate(multiple) for block in self.blocks), default=0)

    def set_attention_impl(self, impl: str) -> None:
        """Choose the window/full attention kernel: ``auto`` (default, or ``UNIFIEDSERVE_VISION_ATTENTION``),
        ``grouped``, ``padded``, ``flashinfer`` or ``varlen`` (see :mod:`unifiedserve.attention.varlen`).
        Raises ``ValueError`` on other names."""
        check_varlen_impl(impl)
        for block in self.blocks:
            block.attn.attention_impl = impl

    def _rotary(self, patch_hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D rotary tables: the first half of each head's pairs turns with the row, the second
        half with the column. ``patch_hw`` int64 [N, 2] -> cos, sin float32 [N, head_dim]."""
        dim = self.config.head_dim // 2
        inv_freq = 1.0 / (self.config.rope_theta ** (
            torch.arange(0, dim, 2, dtype=torch.float, device=patch_hw.device) / dim))  # [head_dim / 4]
        freqs = (patch_hw.float()[..., None] * inv_freq).flatten(1)  # [N, head_dim / 2]: rows, then cols
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, head_dim]
        return emb.cos(), emb.sin()


def _check_grids(grid_thw: Sequence[Grid], merge_size: int) -> tuple[Grid, ...]:
    if isinstance(grid_thw, torch.Tensor):
        grid_thw = grid_thw.tolist()
    grids = tuple(tuple(int(v) for v in g) for g in grid_thw)
    if not grids:
        raise ValueError("grid_thw is empty; pass one (t, h, w) per image or video")
    for g in grids:
        if len(g) != 3 or min(g) <= 0 or g[1] % merge_size or g[2] % merge_size:
            raise ValueError(f"grid {g} must be (t, h, w) with positive values and h, w multiples of "
                             f"spatial_merge_size ({merge_size})")
    return grids  # type: ignore[return-value]
