"""The single-process engine: scheduler (bookkeeping), model runner (tensors), LLM (the loop).

Names are imported lazily so the pure bookkeeping modules (``scheduler``, ``request``,
``params``) load without torch.
"""

import importlib

_EXPORTS = {
    "LLM": "unifiedserve.engine.llm", "EngineConfig": "unifiedserve.engine.llm",
    "RequestOutput": "unifiedserve.engine.llm", "SamplingParams": "unifiedserve.engine.params",
    "SchedulerConfig": "unifiedserve.engine.scheduler", "VisionInput": "unifiedserve.engine.inputs",
    "MediaGrid": "unifiedserve.engine.inputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'unifiedserve.engine' has no attribute {name!r}")
