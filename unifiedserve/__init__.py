"""UnifiedServe: a multi-process serving runtime for vision-language models on long videos.

Processes (see docs/architecture.md): api (OpenAI-compatible HTTP), vision (video/image decoding
with :mod:`flashcodec`), core (vision encoder and chunked prefill under token budgets) and decode
(LLM token generation), sharing the KV cache and the model's weights. :mod:`unifiedserve.engine`
is the same engine in one process.
"""

__version__ = "0.1.0"
