"""Where a traced request's decode time went (``add_decoding_request(..., trace=True)``), per rank and in one line.

The trace is the request's :class:`~flashcodec.decode.rank_job.SlotEvent` list: every decoder open and segment
decode, with start and end in seconds from the request's queueing. :func:`trace_summary` sums it per rank;
:func:`describe_trace` says it in one line (the server logs it per video with ``UNIFIEDSERVE_DECODE_TRACE=1``).
"""

from __future__ import annotations

__all__ = ["describe_rank", "describe_trace", "rank_slots", "trace_summary"]


def rank_slots(engine) -> dict[str, int]:
    """Decoder slots per rank of a :class:`~flashcodec.decode.engine.DecodeEngine`, by the names traces give ranks."""
    layout = engine.layout
    return {**{f"cuda:{gpu}": layout.nvdec_sessions for gpu in layout.gpus},
            **({"cpu": layout.cpu_threads} if layout.cpu_threads else {})}


def trace_summary(events, wall_s: float, slots: dict[str, int]) -> dict:
    """Where one traced request's time went, per rank (``slots``: decoder slots per rank).

    Per rank: ``busy``, its opens and decodes over its slots x the request's wall time (1.0: no slot idle);
    ``opens``, ``open_s_sum``/``open_s_max`` and ``open_end_s`` (when its last open ended), its decoder opens
    (opens that run one after another in the driver show as a late ``open_end_s`` with short opens);
    ``first_decode_s``, when its first segment started; ``slowest_segment_s``, its longest segment decode (a slot's
    first segment also pays for creating its hardware decoder); ``end_s``, when its last work ended.
    ``first_segment``: the decode of the video's earliest segment (the first decode of the lowest
    ``start_position``), which bounds when a stream's first part can come out, with
    ``open_start_s``/``open_end_s``, the open its slot made just before it (None: its slot had a decoder open).
    ``last``: the event that ended last (the request's tail).
    """
    out: dict = {"wall_s": wall_s, "ranks": {}}
    for rank, n in slots.items():
        mine = [e for e in events if e.rank == rank]
        opens = [e.end_s - e.start_s for e in mine if e.kind == "open"]
        decodes = [e for e in mine if e.kind == "decode"]
        work = sum(e.end_s - e.start_s for e in mine)
        out["ranks"][rank] = {
            "slots": n, "slots_used": len({e.slot for e in mine}), "segments": len(decodes),
            "stolen": sum(e.stolen for e in decodes), "backups": sum(e.backup for e in decodes),
            "frames": sum(e.cost for e in decodes),
            "opens": len(opens), "open_s_sum": sum(opens), "open_s_max": max(opens, default=0.0),
            "open_end_s": max((e.end_s for e in mine if e.kind == "open"), default=None),
            "decode_s_sum": sum(e.end_s - e.start_s for e in decodes),
            "slowest_segment_s": max((e.end_s - e.start_s for e in decodes), default=0.0),
            "first_decode_s": min((e.start_s for e in decodes), default=None),
            "end_s": max((e.end_s for e in mine), default=None),
            "busy": work / (n * wall_s) if n and wall_s > 0 else None,
        }
    decodes = [e for e in events if e.kind == "decode"]
    if decodes:
        first = min(decodes, key=lambda e: (e.start_position, e.start_s))
        # its slot's open, when the slot opened a decoder for it: the slot's latest open that ended by its start
        opened = [e for e in events if e.kind == "open" and e.rank == first.rank and e.slot == first.slot
                  and e.end_s <= first.start_s + 1e-9]
        own = max(opened, key=lambda e: e.end_s, default=None)
        out["first_segment"] = {"rank": first.rank, "slot": first.slot, "start_s": first.start_s,
                                "end_s": first.end_s, "cost": first.cost,
                                "open_start_s": None if own is None else own.start_s,
                                "open_end_s": None if own is None else own.end_s}
    if events:
        last = max(events, key=lambda e: e.end_s)
        out["last"] = {"rank": last.rank, "slot": last.slot, "kind": last.kind, "start_s": last.start_s,
                       "end_s": last.end_s, "cost": last.cost}
    return out


def describe_rank(rank: str, t: dict) -> str:
    """One rank of a :func:`trace_summary` in words."""
    busy = "n/a" if t["busy"] is None else f"{t['busy']:.2f}"
    last_open = "" if t.get("open_end_s") is None else f", the last ended at {t['open_end_s']:.3f} s"
    return (f"{rank}: {t['segments']} segments ({t['stolen']} stolen, {t['backups']} backups) on {t['slots_used']}/"
            f"{t['slots']} slots, first decode {t['first_decode_s']:.3f} s, slowest segment "
            f"{t['slowest_segment_s']:.3f} s, end {t['end_s']:.3f} s, busy {busy}, {t.get('opens', 0)} opens "
            f"{t['open_s_sum']:.3f} s (max {t['open_s_max']:.3f}{last_open})")


def describe_trace(summary: dict) -> str:
    """One line of a :func:`trace_summary`: the wall time, the first segment, then each rank that decoded anything."""
    parts = [f"{summary['wall_s']:.3f} s"]
    first = summary.get("first_segment")
    if first:
        opened = "" if first["open_start_s"] is None else \
            f" after its open {first['open_start_s']:.3f}-{first['open_end_s']:.3f} s"
        parts.append(f"first segment on {first['rank']} slot {first['slot']} {first['start_s']:.3f}-"
                     f"{first['end_s']:.3f} s{opened}")
    parts += [describe_rank(rank, t) for rank, t in summary["ranks"].items() if t["segments"]]
    return "; ".join(parts)
