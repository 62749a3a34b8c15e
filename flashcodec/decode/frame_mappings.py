"""torchcodec's frame mappings built from our probe, once per video, for every torchcodec decoder that opens it.

A torchcodec ``VideoDecoder`` given ``custom_frame_mappings`` seeks exactly without scanning the file. flashcodec
opens one per slot and request (up to 14 NVDEC sessions per GPU, and the CPU rank's threads with the torchcodec
backend), all from the same probe: the mappings are built once per probe (:func:`frame_mappings`), and their
tensors handed to torchcodec without its parse of the JSON text (:func:`use_parsed_mappings`).
"""

from __future__ import annotations

import functools
import json
import threading

import numpy as np
import torch

from flashcodec._probe import VideoInfo, per_probe
from flashcodec.decode import fast_open


class FrameMappings(str):
    """torchcodec's ``custom_frame_mappings`` JSON text that also carries the three tensors torchcodec parses out of
    it (``pts`` int64, ``key_frame`` bool, ``duration`` int64, in file order), so that a session's open skips the
    parse (see :func:`use_parsed_mappings`)."""

    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@per_probe  # a 60 s 30 fps clip's text takes 2-8 ms to build on two cores
def frame_mappings(info: VideoInfo) -> FrameMappings:
    """torchcodec's ``custom_frame_mappings`` from our probe, so a session does not rescan the file (built once
    per probe, kept while the probe lives)."""
    pts = np.asarray(info.frame_pts, dtype=np.int64)
    last = int(pts[-1] - pts[-2]) if info.num_frames > 1 else 1
    durations = np.diff(pts, append=pts[-1] + last)
    keyframe = np.isin(pts, pts[np.isin(info.decode_positions, info.keyframe_positions)])
    mappings = FrameMappings(json.dumps({"frames": [
        {"pts": p, "duration": d, "key_frame": int(k)}
        for p, d, k in zip(pts.tolist(), durations.tolist(), keyframe.tolist())
    ]}))
    mappings.tensors = (torch.from_numpy(pts.copy()), torch.from_numpy(keyframe), torch.from_numpy(durations))
    use_parsed_mappings()
    return mappings


_parse_hook_lock = threading.Lock()


def use_parsed_mappings() -> bool:
    """Let torchcodec's ``VideoDecoder`` take a :class:`FrameMappings`' tensors instead of parsing its JSON again.

    Why: the parse is pure Python under the GIL (``json.loads`` and three list comprehensions over every frame:
    5 ms for a 4500-frame video on the development machine, against 1.6 ms for the rest of the open). A request
    opens one decoder per slot at the same moment, 14 per GPU, beside the slots already decoding, and in the
    third H100 run those opens took 0.19 s each (first decode 0.15 s into a 1.35 s request). Measured here with
    14 threads opening at once: 14 ms per open with the parse, 3 ms without. On the H100 (fourth run, 150-s
    H.264) the 14 opens fell from 2.70 s in all to 1.43 s, the first decode from 0.146 s to 0.093 s; what is
    left there is FFmpeg's stream-info decode of each H.264 open, which torchcodec gives no way to skip.

    How: torchcodec's public API takes the mappings only as JSON; its module-level parser
    (``torchcodec.decoders._video_decoder._read_custom_frame_mappings``, torchcodec 0.13-0.16) is wrapped so that
    a :class:`FrameMappings` returns its tensors and anything else is parsed as before, for every other caller in
    the process. Where that function is missing (another torchcodec), nothing is wrapped and the JSON is parsed.
    Returns whether the wrapper is in place.
    """
    fast_open.install()  # whoever imports torchcodec first decides; this module is imported early
    try:
        from torchcodec.decoders import _video_decoder as vd
    except Exception:  # not installed, or its FFmpeg libraries do not load (RuntimeError): nothing to wrap
        return False
    with _parse_hook_lock:
        parse = getattr(vd, "_read_custom_frame_mappings", None)
        if parse is None:
            return False
        if getattr(parse, "_flashcodec_parsed", False):
            return True

        @functools.wraps(parse)
        def read_custom_frame_mappings(custom_frame_mappings):
            if isinstance(custom_frame_mappings, FrameMappings):
                return custom_frame_mappings.tensors
            return parse(custom_frame_mappings)

        read_custom_frame_mappings._flashcodec_parsed = True
        vd._read_custom_frame_mappings = read_custom_frame_mappings
        return True
