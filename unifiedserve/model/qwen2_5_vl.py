"""Qwen2.5-VL: the vision tower and the language model behind one small API.

A request's life through the model::

    visual_tokens = model.encode_vision(patches, grid_thw)        # [V, hidden], per media
    embeds = model.embed(input_ids, visual_tokens)                 # [L, hidden], placeholders filled
    positions, delta = get_rope_index(ids, image_grids, video_grids, seconds, config)   # rope.py
    attn.begin(AttentionMetadata.build(...))
    hidden = model(embeds, positions, attn)                        # [L, hidden]
    logits = model.compute_logits(hidden[last_rows])               # [M, vocab]

Encoding and prefill are separate calls so that a serving runtime can run them in different
processes, split a video into temporal slices, and prefill in chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from unifiedserve.attention import AttentionBackend
from unifiedserve.model.config import ModelConfig
from unifiedserve.model.llm import LanguageModel
from unifiedserve.model.vision import VisionTower

__all__ = ["Qwen2_5_VL"]


class Qwen2_5_VL(nn.Module):
    """Qwen2.5-VL for inference. Build with :func:`unifiedserve.model.load_model`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.visual = VisionTower(config.vision)
        self.language_model = LanguageModel(config.text, config.tie_word_embeddings)

    def encode_vision(self, patches: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """Visual tokens ``[sum(t*h*w) / merge**2, hidden]`` of images/videos; see :class:`VisionTower`."""
        return self.visual(patches, grid_thw)

    def embed(self, input_ids: torch.Tensor, visual_tokens: torch.Tensor | None = None,
              visual_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with visual tokens written over the placeholder rows.

        Args:
            input_ids: int64 ``[N]`` (a whole prompt or a chunk of one).
            visual_tokens: ``[V, hidden]``, one row per image or video placeholder in ``input_ids``,
                in the order the placeholders appear (media in prompt order, each media's tokens in
                the order :meth:`encode_vision` returns them). ``None`` when there are none.
            visual_mask: bool ``[N]``, the rows that take visual tokens. Default: every placeholder
                id. Decode rows pass False: a generated token is text even when it has a placeholder id.
        Returns:
            ``[N, hidden]`` in the model's dtype.
        Raises:
            ValueError: the number of placeholders differs from ``V``.
        """
        embeds = self.language_model.embed_tokens(input_ids)  # [N, hidden]
        if visual_mask is None:
            visual_mask = (input_ids == self.config.image_token_id) | (input_ids == self.config.video_token_id)
        is_visual = visual_mask  # [N]
        num_placeholders = int(is_visual.sum())
        num_visual = 0 if visual_tokens is None else visual_tokens.shape[0]
        if num_placeholders != num_visual:
            raise ValueError(f"input_ids has {num_placeholders} image/video placeholder tokens but "
                             f"{num_visual} visual tokens were given")
        if num_visual:
            embeds[is_visual] = visual_tokens.to(embeds.dtype)
        return embeds

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Final hidden states ``[N, hidden]`` of a flattened batch; see :meth:`LanguageModel.forward`."""
        return self.language_model(inputs_embeds, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[M, hidden]`` -> ``[M, vocab_size]``."""
        return self.language_model.compute_logits(hidden)
