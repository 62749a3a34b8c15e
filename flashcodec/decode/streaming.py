"""A streamed request's output (``add_decoding_request(..., stream=True)``) cut into parts as it completes.

:class:`StreamParts` reads one request alone: it yields a :class:`~flashcodec.decode.request.DecodedSlice` each
time the prefix of final frames grows (every new frame for ``output="rgb"``, every new whole temporal patch for
``output="patches"``, patchified from that part's frames alone), and frees a rank's buffer once all its frames
are out. The engine (:meth:`flashcodec.decode.engine.DecodeEngine.stream_decoding_output`) wraps it with what
concerns its other requests: the request's end, a cancel, and a reader that goes away.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from flashcodec.decode.request import DecodedSlice, DecodeRequest, wait_until


class StreamParts:
    """The parts of one streamed request's output; their size is fixed here, before its reader starts."""

    def __init__(self, request: DecodeRequest):
        self.request = request
        plan = request.analysis.plan
        spec = request.patch_spec
        if request.output == "patches" and spec is None:
            from flashcodec.patches import PatchSpec

            spec = PatchSpec()
        self.spec = spec
        self.grid = plan.grid_thw(spec.patch_size, spec.temporal_patch_size) if spec is not None else plan.grid_thw()
        self.unit = 1  # frames per step of a part
        self.rows_per_unit = 1  # output rows per step
        if request.output == "patches":  # whole temporal patches of grid_h * grid_w patch rows each
            self.unit, self.rows_per_unit = spec.temporal_patch_size, self.grid[1] * self.grid[2]

    def read(self, deadline: float | None, timeout: float | None) -> Iterator[DecodedSlice]:
        """Yield the parts in display order until every output row is out, or until the request is cancelled
        (then no further part: the caller raises for it). A traced request's last part waits for every slot to
        end its work on it, and carries the whole trace.

        Raises:
            TimeoutError: past ``deadline`` (``time.monotonic()``; ``timeout`` is the caller's, for the message).
        """
        request, spec, grid, unit, rows_per_unit = self.request, self.spec, self.grid, self.unit, self.rows_per_unit
        key_id = request.analysis.key_id
        delivered = 0  # frames handed out
        while True:
            with request.changed:
                while not (request.finished or request.cancelled
                           or request.num_ready - request.num_ready % unit > delivered):
                    wait_until(request.changed, deadline, timeout)
                ready = request.num_ready - request.num_ready % unit
                stopped = request.cancelled
            if stopped or ready == delivered:  # the end: cancelled, or every final row handed out
                return
            trace = None
            if request.trace is not None and ready == request.num_frames:  # the last part: the whole trace
                with request.changed:
                    while not (request.finished or request.cancelled):
                        wait_until(request.changed, deadline, timeout)
                if request.cancelled:  # as untraced: no part after a cancel (its trace would be partial)
                    return
                trace = list(request.trace[1])
            frames = request.take_rows(delivered, ready).permute(0, 3, 1, 2)  # [n, 3, H, W]
            patches = None
            if request.output == "patches":
                from flashcodec.patches import frames_to_patches

                patches, _ = frames_to_patches(frames, spec, dtype=request.patch_dtype)
                frames = None
            yield DecodedSlice(key_id, delivered // unit * rows_per_unit, ready // unit * rows_per_unit,
                               request.num_frames // unit * rows_per_unit, frames, patches, tuple(grid),
                               time.perf_counter() - request.started, trace)
            delivered = ready
