"""Workload JSONL: validate one request record, write records, read and validate a file."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Iterable

__all__ = ["read_workload", "validate_record", "write_workload"]


def validate_record(rec) -> dict:
    """Check one request record; returns it. Raises ValueError saying which field is wrong."""

    def bad(msg):
        raise ValueError(msg)

    if not isinstance(rec, dict):
        bad(f"expected a JSON object, got {type(rec).__name__}")
    for key in ("request_id", "arrival_s", "prompt", "media", "output_len", "ignore_eos"):
        if key not in rec:
            bad(f"missing field {key!r}")
    if not isinstance(rec["request_id"], str) or not rec["request_id"]:
        bad("request_id must be a non-empty string")
    t = rec["arrival_s"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
        bad(f"arrival_s must be a finite number >= 0, got {t!r}")
    if not isinstance(rec["prompt"], str):
        bad("prompt must be a string")
    n = rec["output_len"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        bad(f"output_len must be an integer >= 1, got {n!r}")
    if not isinstance(rec["ignore_eos"], bool):
        bad(f"ignore_eos must be true or false, got {rec['ignore_eos']!r}")
    if not isinstance(rec["media"], list):
        bad("media must be a list")
    for k, m in enumerate(rec["media"]):
        if not isinstance(m, dict) or m.get("type") not in ("video", "image"):
            bad(f"media[{k}].type must be 'video' or 'image'")
        if not isinstance(m.get("path"), str) or not m["path"]:
            bad(f"media[{k}].path must be a non-empty string")
        fps, max_frames = m.get("fps"), m.get("max_frames")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
            bad(f"media[{k}].fps must be null or a number > 0, got {fps!r}")
        if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(max_frames, int)
                                       or max_frames < 1):
            bad(f"media[{k}].max_frames must be null or an integer >= 1, got {max_frames!r}")
    return rec


def write_workload(records: Iterable[dict], path) -> pathlib.Path:
    """Write records as JSONL (one compact object per line); returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(", ", ": ")) + "\n")
    return path


def read_workload(path) -> list[dict]:
    """Read and validate a workload JSONL; blank lines are skipped.

    Raises FileNotFoundError for a missing file and ValueError ``"PATH:LINE: what is wrong"`` for
    a line that is not valid JSON, fails :func:`validate_record`, or repeats a request_id.
    """
    path = pathlib.Path(path)
    records, seen = [], {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = validate_record(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            if rec["request_id"] in seen:
                raise ValueError(f"{path}:{lineno}: request_id {rec['request_id']!r} repeats line "
                                 f"{seen[rec['request_id']]}")
            seen[rec["request_id"]] = lineno
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: no requests")
    return records
