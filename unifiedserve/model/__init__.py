"""Qwen2.5-VL for the UnifiedServe runtime: config, vision tower, language model, loader, processor.

Quick use::

    from unifiedserve.model import load_model, load_processor, get_rope_index
    model, config = load_model("~/.cache/unifiedserve/demo-model")   # `unifiedserve demo-model` writes it
    processor = load_processor("~/.cache/unifiedserve/demo-model")
"""

import importlib

# Names are imported on first use, so that e.g. the CLI can read the presets without importing torch.
_EXPORTS = {
    "ModelConfig": "config", "TextConfig": "config", "VisionConfig": "config", "LanguageModel": "llm",
    "CheckpointError": "loader", "load_model": "loader", "IncrementalDecoder": "processor",
    "Processor": "processor", "load_processor": "processor", "Qwen2_5_VL": "qwen2_5_vl",
    "decode_positions": "rope", "get_rope_index": "rope", "VisionTower": "vision",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'unifiedserve.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"unifiedserve.model.{_EXPORTS[name]}"), name)
