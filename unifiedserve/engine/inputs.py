"""Vision inputs for the engine: images and videos as Qwen2.5-VL patches, split into encode items."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.request import EncodeItem, Request


@dataclass(frozen=True)
class MediaGrid:
    """What the engine must know of one image or video before its pixels exist: kind and patch grid.

    A video's ``grid_thw`` is ``(t, h, w)`` with ``t`` temporal patches; ``second_per_grid_t`` is
    the time one temporal patch spans (M-RoPE's temporal positions).
    """

    kind: str  # "image" | "video"
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float = 1.0

    def encode_items(self, media_index: int, merge_size: int = 2) -> list[EncodeItem]:
        """One item per image, or one per temporal slice of a video (exact: no attention across slices)."""
        t, h, w = self.grid_thw
        per_slice = h * w
        return [EncodeItem(media_index, per_slice, per_slice // (merge_size * merge_size), (1, h, w))
                for _ in range(t)]

    @property
    def num_patch_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    def num_visual_tokens(self, merge_size: int = 2) -> int:
        return self.num_patch_tokens // (merge_size * merge_size)


def make_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 media: "list[MediaGrid] | list[VisionInput]", model_config) -> Request:
    """A :class:`Request` whose media are split into encode items, placeholders located in the prompt."""
    merge = model_config.vision.spatial_merge_size
    items = [item for i, m in enumerate(media) for item in m.encode_items(i, merge)]
    visual_ids = {model_config.image_token_id, model_config.video_token_id}
    positions = [i for i, t in enumerate(prompt_token_ids) if t in visual_ids]
    return Request(request_id, list(prompt_token_ids), params, items, positions)


@dataclass(eq=False)
class VisionInput:
    """One image or video, already in patches (e.g. from flashcodec with ``output="patches"``).

    A video's ``grid_thw`` is ``(t, h, w)`` with ``t`` temporal patches (frame pairs); an image's
    is ``(1, h, w)``. ``second_per_grid_t`` (videos) is the time one temporal patch spans, which
    sets M-RoPE's temporal positions: ``temporal_patch_size / sample_fps``.
    """

    kind: str  # "image" | "video"
    patches: torch.Tensor  # [t*h*w, 3*temporal*patch*patch]
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("image", "video"):
            raise ValueError(f"kind must be 'image' or 'video', got {self.kind!r}")
        t, h, w = self.grid_thw
        if self.patches.dim() != 2 or self.patches.shape[0] != t * h * w:
            raise ValueError(f"{self.kind} patches have shape {tuple(self.patches.shape)}, "
                             f"expected [{t * h * w}, patch_dim] for grid {self.grid_thw}")
        if self.kind == "image" and t != 1:
            raise ValueError(f"an image's grid must have t == 1, got {self.grid_thw}")

    @property
    def grid(self) -> MediaGrid:
        return MediaGrid(self.kind, tuple(self.grid_thw), self.second_per_grid_t)

    def encode_items(self, media_index: int, merge_size: int = 2) -> list[EncodeItem]:
        """One item per image, or one per temporal slice of a video (exact: no attention across slices)."""
        return self.grid.encode_items(media_index, merge_size)

    def num_visual_tokens(self, merge_size: int = 2) -> int:
        return self.grid.num_visual_tokens(merge_size)

    @classmethod
    def from_video(cls, decoded, temporal_patch_size: int = 2) -> "VisionInput":
        """From a :class:`flashcodec.DecodedVideo` decoded with ``output="patches"``."""
        if decoded.patches is None:
            raise ValueError("decode the video with output='patches'")
        return cls("video", decoded.patches, tuple(decoded.grid_thw), temporal_patch_size / decoded.sample_fps)

    @classmethod
    def from_image(cls, decoded, spec=None) -> "VisionInput":
        """From a :class:`flashcodec.DecodedImage`."""
        patches, grid = decoded.to_patches(spec) if spec is not None else decoded.to_patches()
        return cls("image", patches, tuple(grid))
