"""Qwen2.5-VL model configuration, parsed from a Hugging Face ``config.json``.

Two layouts exist in the wild and both are read:

* transformers 5 (what ``save_pretrained`` writes today): the language model's fields sit in a
  nested ``text_config`` with ``rope_parameters = {"rope_theta", "mrope_section", ...}``;
* the legacy flat layout of the published checkpoints (``Qwen/Qwen2.5-VL-7B-Instruct``): the
  language model's fields sit at the top level with ``rope_theta`` and
  ``rope_scaling = {"type": "mrope", "mrope_section": [...]}``.

Missing keys take transformers' defaults for Qwen2.5-VL, except the sizes, which are required.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelConfig", "TextConfig", "VisionConfig", "SUPPORTED_ACTIVATIONS"]

#: Activation names (as in ``hidden_act``) the model implements.
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu")


def _int(value: Any, name: str) -> int:
    """A config integer: an int, or a float with no fraction (some exporters write 3584.0); never a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float)
                                                                         and not value.is_integer()):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _float(value: Any, name: str) -> float:
    """A config number: finite, never a bool or a string."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _ints(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    return tuple(_int(v, f"{name}[{i}]") for i, v in enumerate(value))


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value


def _positive(owner: str, **values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (ViT with window attention, then a 2x2 patch merger).

    Defaults are Qwen2.5-VL-7B's.
    """

    depth: int = 32
    hidden_size: int = 1280
    num_heads: int = 16
    intermediate_size: int = 3420
    #: Width of a visual token after the merger: the language model's hidden size.
    out_hidden_size: int = 3584
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    #: Side of an attention window in pixels (112 px = 8x8 patches = 4x4 merged tokens).
    window_size: int = 112
    #: Blocks that attend over a whole frame pair; every other block attends inside its window.
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    #: Temporal M-RoPE positions per second of video (scaled by ``second_per_grid_ts``).
    tokens_per_second: float = 2
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        _positive("vision", depth=self.depth, hidden_size=self.hidden_size, num_heads=self.num_heads,
                  intermediate_size=self.intermediate_size, out_hidden_size=self.out_hidden_size,
                  patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
                  spatial_merge_size=self.spatial_merge_size, in_channels=self.in_channels,
                  window_size=self.window_size)
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision.hidden_size ({self.hidden_size}) must be divisible by vision.num_heads "
                             f"({self.num_heads})")
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim ({self.head_dim}) must be a multiple of 4 for the 2-D rotary "
                             "embedding; change hidden_size or num_heads")
        unit = self.patch_size * self.spatial_merge_size
        if self.window_size % unit:
            raise ValueError(f"vision.window_size ({self.window_size}) must be a multiple of patch_size * "
                             f"spatial_merge_size ({unit})")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"vision.fullatt_block_indexes {bad} are outside 0..{self.depth - 1} (depth {self.depth})")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"vision.hidden_act {self.hidden_act!r} is not supported; "
                             f"use one of {SUPPORTED_ACTIVATIONS}")
        for name, value in (("tokens_per_second", self.tokens_per_second), ("rope_theta", self.rope_theta)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"vision.{name} must be a positive finite number, got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row: ``in_channels * temporal_patch_size * patch_size**2`` (1176)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one visual token (4)."""
        return self.spatial_merge_size**2

    @property
    def window_merge_units(self) -> int:
        """Side of an attention window in merged tokens (4 with the defaults)."""
        return self.window_size // (self.patch_size * self.spatial_merge_size)


@dataclass(frozen=True)
class TextConfig:
    """The Qwen2 decoder. Defaults are Qwen2.5-VL-7B's."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    #: Rotary frequency pairs per M-RoPE axis (temporal, height, width); sums to ``head_dim // 2``.
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    hidden_act: str = "silu"
    max_position_embeddings: int = 128000

    def __post_init__(self) -> None:
        _positive("text", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                  intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                  num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                  max_position_embeddings=self.max_position_embeddings)
        object.__setattr__(self, "mrope_section", tuple(int(s) for s in self.mrope_section))
        if not 0 < self.rope_theta < math.inf:  # NaN too: every position's rotation NaN, every token garbage
            raise ValueError(f"text.rope_theta must be a positive finite number, got {self.rope_theta!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"text.hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"text.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"text.mrope_section {list(self.mrope_section)} must have 3 entries summing to "
                             f"head_dim // 2 = {self.head_dim // 2}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"text.hidden_act {self.hidden_act!r} is not supported; "
                             f"use one of {SUPPORTED_ACTIVATIONS}")
        if not 0 < self.rms_norm_eps < math.inf:
            raise ValueError(f"text.rms_norm_eps must be a positive finite number, got {self.rms_norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class ModelConfig:
    """A whole Qwen2.5-VL model: vision tower, language model and the special token ids."""

    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    bos_token_id: int | None = 151643
    eos_token_ids: tuple[int, ...] = (151645,)
    #: The output projection reuses the token embedding (no ``lm_head.weight`` in the checkpoint).
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(f"vision.out_hidden_size ({self.vision.out_hidden_size}) must equal the language "
                             f"model's hidden_size ({self.text.hidden_size})")
        ids = {"image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
               "vision_start_token_id": self.vision_start_token_id, "vision_end_token_id": self.vision_end_token_id}
        ids.update({f"eos_token_ids[{i}]": t for i, t in enumerate(self.eos_token_ids)})
        if self.bos_token_id is not None:
            ids["bos_token_id"] = self.bos_token_id
        bad = {k: v for k, v in ids.items() if not 0 <= v < self.text.vocab_size}
        if bad:
            raise ValueError(f"token ids {bad} are outside the vocabulary (vocab_size {self.text.vocab_size})")
        if self.image_token_id == self.video_token_id:
            raise ValueError("image_token_id and video_token_id must differ")

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face Qwen2.5-VL config dict (nested or flat layout).

        Raises:
            ValueError: the model type is not Qwen2.5-VL, a size is missing, or a value is invalid.
        """
        cfg = _mapping(cfg, "config")
        model_type = cfg.get("model_type")
        if model_type not in (None, "qwen2_5_vl"):
            raise ValueError(f"config model_type is {model_type!r}; only 'qwen2_5_vl' (Qwen2.5-VL) is supported")
        text_cfg = _mapping(cfg.get("text_config") or cfg, "text_config")  # nested (transformers 5) or flat (legacy)
        vision_cfg = cfg.get("vision_config")
        if vision_cfg is None:
            raise ValueError("config has no 'vision_config'; is this a Qwen2.5-VL checkpoint?")
        eos = _first(text_cfg, cfg, "eos_token_id", default=151645)
        eos_ids = _ints(eos, "eos_token_id") if isinstance(eos, (list, tuple)) else (_int(eos, "eos_token_id"),)
        if not eos_ids:
            raise ValueError("eos_token_id must name at least one token, got []")
        tie = [v for v in (cfg.get("tie_word_embeddings"), text_cfg.get("tie_word_embeddings")) if v is not None]
        if any(not isinstance(v, bool) for v in tie):
            raise ValueError(f"tie_word_embeddings must be true or false, got {tie!r}")
        bos = _first(text_cfg, cfg, "bos_token_id", default=None)
        ids = {name: _int(cfg.get(name, default), name) for name, default in (
            ("image_token_id", 151655), ("video_token_id", 151656), ("vision_start_token_id", 151652),
            ("vision_end_token_id", 151653))}
        return cls(
            text=_text_config(text_cfg),
            vision=_vision_config(_mapping(vision_cfg, "vision_config")),
            **ids,
            bos_token_id=None if bos is None else _int(bos, "bos_token_id"),
            eos_token_ids=eos_ids,
            tie_word_embeddings=any(tie),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers 5 ``config.json`` layout (nested ``text_config``), loadable by
        ``Qwen2_5_VLForConditionalGeneration.from_pretrained`` and by :meth:`from_dict`."""
        t, v = self.text, self.vision
        return {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "dtype": "float32",
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": {
                "model_type": "qwen2_5_vl_text",
                "vocab_size": t.vocab_size, "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_hidden_layers, "num_attention_heads": t.num_attention_heads,
                "num_key_value_heads": t.num_key_value_heads, "hidden_act": t.hidden_act,
                "rms_norm_eps": t.rms_norm_eps, "max_position_embeddings": t.max_position_embeddings,
                "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta,
                                    "mrope_section": list(t.mrope_section)},
                "use_sliding_window": False,
                "bos_token_id": self.bos_token_id,
                "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0],
            },
            "vision_config": {
                "model_type": "qwen2_5_vl_vision",
                "depth": v.depth, "hidden_size": v.hidden_size, "num_heads": v.num_heads,
                "intermediate_size": v.intermediate_size, "out_hidden_size": v.out_hidden_size,
                "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
                "spatial_merge_size": v.spatial_merge_size, "in_channels": v.in_channels,
                "window_size": v.window_size, "fullatt_block_indexes": list(v.fullatt_block_indexes),
                "tokens_per_second": v.tokens_per_second, "hidden_act": v.hidden_act,
                "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
            },
        }

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (or the ``config.json`` inside a checkpoint directory).

        The end-of-sequence ids are ``config.json``'s and then those of a ``generation_config.json`` beside
        it: transformers' ``generate`` and vLLM stop on the generation config's too (Qwen2.5-VL's instruct
        checkpoints name ``<|im_end|>`` in ``config.json`` and add ``<|endoftext|>`` there).
        """
        from unifiedserve.model.generation import generation_eos_ids, read_generation_config

        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path} not found; a checkpoint directory needs a config.json") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        except IsADirectoryError:
            raise ValueError(f"{path} is a directory, not a config file") from None
        try:
            config = cls.from_dict(cfg)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        extra = [i for i in generation_eos_ids(read_generation_config(path.parent)) if i not in config.eos_token_ids]
        try:
            return dataclasses.replace(config, eos_token_ids=config.eos_token_ids + tuple(extra)) if extra else config
        except ValueError as e:  # an end-of-sequence id of generation_config.json outside the vocabulary
            raise ValueError(f"{path.parent / 'generation_config.json'}: {e}") from None


def _first(primary: Mapping[str, Any], fallback: Mapping[str, Any], key: str, default: Any) -> Any:
    value = primary.get(key)
    return value if value is not None else fallback.get(key, default)


def _required(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise ValueError(f"config is missing {where}{key!r}")
    return cfg[key]


def _text_config(cfg: Mapping[str, Any]) -> TextConfig:
    rope = dict(_mapping(cfg.get("rope_parameters") or {}, "rope_parameters"))
    rope.update({k: v for k, v in _mapping(cfg.get("rope_scaling") or {}, "rope_scaling").items() if k not in rope})
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise ValueError(f"rope type {rope.get('rope_type', rope.get('type'))!r} is not supported; "
                         "Qwen2.5-VL uses plain M-RoPE (rope_type 'default' with mrope_section)")
    if cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported (Qwen2.5-VL checkpoints set it to false)")
    def number(key, default=None, kind=_int):
        value = _required(cfg, key, "text ") if default is None else cfg.get(key, default)
        return kind(value, f"text {key}")

    heads = number("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads")
    return TextConfig(
        vocab_size=number("vocab_size"),
        hidden_size=number("hidden_size"),
        intermediate_size=number("intermediate_size"),
        num_hidden_layers=number("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=heads if kv_heads is None else _int(kv_heads, "text num_key_value_heads"),
        rms_norm_eps=number("rms_norm_eps", 1e-6, _float),
        rope_theta=_float(rope.get("rope_theta", cfg.get("rope_theta", 1000000.0)), "text rope_theta"),
        mrope_section=_ints(rope.get("mrope_section", (16, 24, 24)), "text mrope_section"),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        max_position_embeddings=number("max_position_embeddings", 128000),
    )


def _vision_config(cfg: Mapping[str, Any]) -> VisionConfig:
    rope = _mapping(cfg.get("rope_parameters") or {}, "vision_config rope_parameters")

    def number(key, default=None, kind=_int):
        value = _required(cfg, key, "vision_config ") if default is None else cfg.get(key, default)
        return kind(value, f"vision_config {key}")

    return VisionConfig(
        depth=number("depth"),
        hidden_size=number("hidden_size"),
        num_heads=number("num_heads"),
        intermediate_size=number("intermediate_size"),
        out_hidden_size=number("out_hidden_size"),
        patch_size=_int(cfg.get("patch_size", cfg.get("spatial_patch_size", 14)), "vision_config patch_size"),
        temporal_patch_size=number("temporal_patch_size", 2),
        spatial_merge_size=number("spatial_merge_size", 2),
        in_channels=_int(cfg.get("in_channels", cfg.get("in_chans", 3)), "vision_config in_channels"),
        window_size=number("window_size", 112),
        fullatt_block_indexes=_ints(cfg.get("fullatt_block_indexes", (7, 15, 23, 31)),
                                    "vision_config fullatt_block_indexes"),
        tokens_per_second=number("tokens_per_second", 4, _float),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        rope_theta=_float(rope.get("rope_theta", 10000.0), "vision_config rope_theta"),
    )
