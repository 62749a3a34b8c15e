"""Model architectures to write random-weight checkpoints of: the tiny demo and the public Qwen2.5-VL sizes.

``qwen2.5-vl-3b`` and ``qwen2.5-vl-7b`` carry the architecture values of the public
``Qwen/Qwen2.5-VL-3B-Instruct`` and ``-7B-Instruct`` ``config.json`` files (widths, heads, layers,
vocabulary, rotary settings, the vision tower's depth, windows and full-attention blocks), so that
every GPU benchmark runs offline at the real size. Only the weights are random; the tokenizer is
the demo's (its ids sit inside the preset's vocabulary).

Fewer layers (for tests at real widths) keep the full-attention vision blocks at their relative
places: 32 blocks with full attention at 7, 15, 23, 31 become 8 blocks with it at 1, 3, 5, 7.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from unifiedserve.model.config import TextConfig, VisionConfig

__all__ = ["DEFAULT_DEMO_PATH", "PRESETS", "preset_architecture", "scale_fullatt_blocks"]

#: Where ``unifiedserve demo-model`` writes, and where the server looks when no model is given.
DEFAULT_DEMO_PATH = Path("~/.cache/unifiedserve/demo-model")

_QWEN_VISION = dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, patch_size=14,
                    temporal_patch_size=2, spatial_merge_size=2, in_channels=3, window_size=112,
                    fullatt_block_indexes=(7, 15, 23, 31), tokens_per_second=2, hidden_act="silu")
_QWEN_TEXT = dict(rms_norm_eps=1e-6, rope_theta=1000000.0, mrope_section=(16, 24, 24), hidden_act="silu",
                  max_position_embeddings=128000)

#: name -> (text config values, vision config values, tie_word_embeddings); ``tiny`` comes from demo.py.
_PUBLIC = {
    "qwen2.5-vl-3b": (dict(_QWEN_TEXT, vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                           num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2),
                      dict(_QWEN_VISION, out_hidden_size=2048), True),
    "qwen2.5-vl-7b": (dict(_QWEN_TEXT, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                           num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
                      dict(_QWEN_VISION, out_hidden_size=3584), False),
}
PRESETS = ("tiny", *_PUBLIC)


def scale_fullatt_blocks(fullatt: tuple[int, ...], depth: int, new_depth: int) -> tuple[int, ...]:
    """Full-attention block indexes of a ``depth``-block tower shrunk to ``new_depth`` blocks, at the
    same relative places (block ``i`` ends at fraction ``(i + 1) / depth`` of the tower)."""
    if new_depth < len(fullatt):
        raise ValueError(f"{new_depth} vision layers cannot keep the {len(fullatt)} full-attention blocks; "
                         f"use at least {len(fullatt)}")
    scaled = tuple(round((i + 1) * new_depth / depth) - 1 for i in fullatt)
    if len(set(scaled)) != len(scaled):
        raise ValueError(f"{new_depth} vision layers cannot keep the full-attention blocks apart; use a multiple "
                         f"of {len(fullatt)}")
    return scaled


def preset_architecture(name: str, *, num_text_layers: int | None = None, num_vision_layers: int | None = None,
                        vocab_size: int | None = None) -> tuple[TextConfig, VisionConfig, bool]:
    """The text and vision configs and ``tie_word_embeddings`` of a public preset.

    Args:
        name: ``qwen2.5-vl-3b`` or ``qwen2.5-vl-7b`` (``tiny`` is built by the demo writer).
        num_text_layers, num_vision_layers: fewer layers than the public model (tests at real widths).
        vocab_size: a smaller vocabulary (it only narrows the embedding and the output projection).
    Raises:
        ValueError: an unknown name, or layer counts that cannot keep the architecture's structure.
    """
    if name not in _PUBLIC:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    text_values, vision_values, tie = _PUBLIC[name]
    text, vision = TextConfig(**text_values), VisionConfig(**vision_values)
    for flag, value in (("num_text_layers", num_text_layers), ("num_vision_layers", num_vision_layers),
                        ("vocab_size", vocab_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    for flag, value, most in (("num_text_layers", num_text_layers, text.num_hidden_layers),
                              ("num_vision_layers", num_vision_layers, vision.depth)):
        if value is not None and value > most:  # fewer layers only (10^8 of them built for minutes, unsaid)
            raise ValueError(f"{flag} must be at most the preset's {most}, got {value}")
    if num_text_layers is not None:
        text = replace(text, num_hidden_layers=num_text_layers)
    if vocab_size is not None:
        text = replace(text, vocab_size=vocab_size)
    if num_vision_layers is not None:
        vision = replace(vision, depth=num_vision_layers, fullatt_block_indexes=scale_fullatt_blocks(
            vision.fullatt_block_indexes, vision.depth, num_vision_layers))
    return text, vision, tie
