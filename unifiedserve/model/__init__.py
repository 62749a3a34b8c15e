"""Qwen2.5-VL for the UnifiedServe runtime: config, vision tower, language model, loader, processor.

Quick use::

    from unifiedserve.model import load_model, load_processor, get_rope_index
    model, config = load_model("~/.cache/unifiedserve/demo-model")   # `unifiedserve demo-model` writes it
    processor = load_processor("~/.cache/unifiedserve/demo-model")
"""

from unifiedserve.model.config import ModelConfig, TextConfig, VisionConfig
from unifiedserve.model.llm import LanguageModel
from unifiedserve.model.loader import CheckpointError, load_model
from unifiedserve.model.processor import IncrementalDecoder, Processor, load_processor
from unifiedserve.model.qwen2_5_vl import Qwen2_5_VL
from unifiedserve.model.rope import decode_positions, get_rope_index
from unifiedserve.model.vision import VisionTower

__all__ = [
    "CheckpointError", "IncrementalDecoder", "LanguageModel", "ModelConfig", "Processor", "Qwen2_5_VL",
    "TextConfig", "VisionConfig", "VisionTower", "decode_positions", "get_rope_index", "load_model",
    "load_processor",
]
