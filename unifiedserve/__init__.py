"""UnifiedServe: a multi-process serving runtime for vision-language models on long videos.

The runtime (vision, encode-prefill and decode processes) is built in later steps; today the
package holds only its skeleton. Video ingest lives in :mod:`flashcodec`.
"""

__version__ = "0.1.0"
