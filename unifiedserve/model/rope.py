"""M-RoPE positions of a Qwen2.5-VL prompt: one ``(temporal, height, width)`` triple per token.

The rule is the one Qwen2.5-VL was released and trained with: the ``get_rope_index`` published
with the model (transformers 4.49 to 5.2, and vLLM's ``MRotaryEmbedding``), for one sequence:

* a run of text tokens continues a counter ``p`` on all three axes: ``p, p+1, ...``;
* a media's placeholder tokens (``t x h/m x w/m`` visual tokens, row-major per frame pair) get
  ``(p + floor(i_t * second_per_grid_t * tokens_per_second), p + i_h, p + i_w)`` for a video
  (the products taken left to right in float32, as the released code multiplies the arange by the
  processor's float32 ``second_per_grid_ts`` and then by the integer ``tokens_per_second``), and
  ``(p, p + i_h, p + i_w)`` for an image;
* after a media the counter restarts at **the largest position so far + 1** (the temporal axis
  included);
* ``delta = max(positions) + 1 - L``; the ``i``-th generated token (0-based) sits at
  ``L + delta + i`` on all three axes.

Why not the installed transformers' rule: from 5.3 transformers advances the counter after a media
by ``max(h, w) / m`` only, ignoring time (transformers issue #45381 shows 348 vs 31 for the same
input). For text after a video whose scaled temporal extent exceeds its spatial one, that puts
the question at positions the model never saw in training, even *before* positions the video's
own frames use. The model must see what it was trained on, so this module keeps the released
rule, and the project's tests state it themselves instead of taking it from whichever
transformers is installed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from unifiedserve.model.config import ModelConfig

__all__ = ["decode_positions", "get_rope_index"]

Grid = Sequence[int]


def get_rope_index(
    input_ids: Sequence[int],
    image_grid_thw: Sequence[Grid] | None,
    video_grid_thw: Sequence[Grid] | None,
    second_per_grid_ts: Sequence[float] | None,
    config: ModelConfig,
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions for one prompt whose placeholders are already expanded.

    Args:
        input_ids: the prompt's token ids; each media is a run of ``t*h*w / merge**2`` image or
            video placeholder tokens, media in the order of their grids.
        image_grid_thw, video_grid_thw: patch grids ``(t, h, w)`` of the images / videos in order.
        second_per_grid_ts: seconds spanned by one temporal grid step per video (``temporal_patch_size
            / fps``); ``None`` means 1.0 for every video.
        config: gives the placeholder ids, merge size and ``tokens_per_second``.
    Returns:
        ``(positions, delta)``: int64 ``[3, L]`` and the offset of decode positions (an int).
    Raises:
        ValueError: placeholder runs do not match the grids, or a grid or time is invalid.
    """
    ids = list(input_ids)
    if not ids:
        raise ValueError("input_ids is empty")
    merge = config.vision.spatial_merge_size
    media = {config.image_token_id: _grids(image_grid_thw, "image_grid_thw"),
             config.video_token_id: _grids(video_grid_thw, "video_grid_thw")}
    videos = media[config.video_token_id]
    seconds = [1.0] * len(videos) if second_per_grid_ts is None else [float(s) for s in second_per_grid_ts]
    if len(seconds) != len(videos):
        raise ValueError(f"second_per_grid_ts has {len(seconds)} values for {len(videos)} videos")
    used = {config.image_token_id: 0, config.video_token_id: 0}

    parts: list[torch.Tensor] = []
    pos = 0  # the counter p
    for token, run in itertools.groupby(ids, key=lambda x: x if x in media else None):
        run_len = sum(1 for _ in run)
        if token is None:  # a run of text
            parts.append(torch.arange(pos, pos + run_len).expand(3, -1))
            pos += run_len
            continue
        kind = "image" if token == config.image_token_id else "video"
        while run_len > 0:  # one run may hold several media of the same kind back to back
            k = used[token]
            if k >= len(media[token]):
                raise ValueError(f"more {kind} placeholder tokens than {kind} grids ({len(media[token])})")
            t, h, w = media[token][k]
            size = t * h * w // merge**2
            if size > run_len:
                raise ValueError(f"{kind} {k} with grid {(t, h, w)} needs {size} placeholder tokens, "
                                 f"found a run of {run_len}")
            second_per_grid = seconds[k] if token == config.video_token_id else None
            media_positions = _media_positions(pos, t, h // merge, w // merge, second_per_grid,
                                               config.vision.tokens_per_second)
            parts.append(media_positions)
            pos = int(media_positions.max()) + 1  # the released rule: past the largest position, time included
            used[token] += 1
            run_len -= size
    for token, grids in media.items():
        if used[token] != len(grids):
            kind = "image" if token == config.image_token_id else "video"
            raise ValueError(f"{len(grids)} {kind} grids but only {used[token]} {kind}s in input_ids")
    positions = torch.cat(parts, dim=1)  # [3, L]
    return positions, int(positions.max()) + 1 - len(ids)


def decode_positions(num_tokens: int, delta: int, count: int = 1) -> torch.Tensor:
    """Positions ``[3, count]`` of the tokens at sequence indices ``num_tokens .. num_tokens+count-1``
    generated after a prompt whose ``get_rope_index`` delta is ``delta``."""
    return torch.arange(num_tokens + delta, num_tokens + delta + count, dtype=torch.int64).expand(3, -1)


def _media_positions(start: int, t: int, h: int, w: int, second_per_grid: float | None,
                     tokens_per_second: int) -> torch.Tensor:
    """``[3, t*h*w]`` positions of one media's visual tokens (row-major per temporal step).

    ``second_per_grid`` is None for an image (every token at temporal offset 0).
    """
    if second_per_grid is None:
        t_pos = torch.zeros(t, dtype=torch.int64)
    else:  # (i_t * s) * tokens_per_second in float32, truncated: the released code's order of operations
        scaled = torch.arange(t) * torch.tensor(second_per_grid, dtype=torch.float32)  # [t] float32
        t_pos = (scaled * tokens_per_second).long()
    return torch.stack([
        t_pos.view(t, 1, 1).expand(t, h, w),
        torch.arange(h).view(1, h, 1).expand(t, h, w),
        torch.arange(w).view(1, 1, w).expand(t, h, w),
    ]).reshape(3, -1) + start


def _grids(grids: Sequence[Grid] | torch.Tensor | None, name: str) -> list[tuple[int, int, int]]:
    if grids is None:
        return []
    if isinstance(grids, torch.Tensor):
        grids = grids.tolist()
    out = [tuple(int(v) for v in g) for g in grids]
    if any(len(g) != 3 or min(g) <= 0 for g in out):
        raise ValueError(f"{name} must be a list of positive (t, h, w), got {grids!r}")
    return out  # type: ignore[return-value]
