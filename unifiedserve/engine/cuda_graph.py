"""Decode steps as CUDA graphs: one graph per captured batch size, replayed on static buffers.

Follows the attention backends' CUDA-graph protocol (``unifiedserve/attention/base.py``):
``init_cuda_graph`` once, then ``plan(seqs, graph_batch_size=B)`` before capture and before every
replay, which only rewrites the backend's fixed metadata buffers. The runner's own static inputs
(token ids and M-RoPE positions, ``B`` rows, padding rows zero) are written the same way, so a
graph captured once serves every later step of at most ``B`` sequences. All graphs share one
memory pool and are captured largest first (the smaller ones reuse its blocks). A backend may offer
more than one graph per size (``graph_variants``: flashinfer's split-KV and split-free decode); each
is captured, and a step replays the one the backend names for its sequences (``graph_variant``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from unifiedserve.engine.runner import RopeTables, feed, run_decoder
from unifiedserve.memory.transfer import write_to
from unifiedserve.ops.tuning import capture

#: The dummy decode step planned for capture: nothing cached, one new token in block 0.
_CAPTURE_SEQ = (0, 1, [0])


class DecodeGraphs:
    """Decode graphs of a model on an attention backend: static buffers now, graphs at :meth:`capture`.

    Before capture (and on any device) :meth:`run_eager` runs the padded step on the static
    buffers without a graph. Capture writes the K/V of a dummy token into block 0, slot 0: capture
    before any request.

    Args:
        model: the loaded model (on a CUDA device).
        attn: its attention backend (``supports_cuda_graph``).
        rope: the model's :class:`RopeTables`.
        batch_sizes: decode batch sizes to capture (each >= 1).
        max_seq_len: longest sequence (cached + the new token) a graph step may hold.

    Raises:
        ValueError: the backend cannot capture or a bad size.
    """

    def __init__(self, model, attn, rope: RopeTables, batch_sizes: Sequence[int], max_seq_len: int):
        if not getattr(attn, "supports_cuda_graph", False):
            raise ValueError(f"{type(attn).__name__} does not support CUDA-graph decode")
        device = model.language_model.tok_embeddings.weight.device
        self.batch_sizes = tuple(sorted(set(int(b) for b in batch_sizes)))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
        self.model, self.attn, self.rope = model, attn, rope
        self.device = device
        self.max_seq_len = max_seq_len
        largest = self.batch_sizes[-1]
        # token ids and M-RoPE positions in one buffer, so that a step sends both up in one copy: a size-B graph
        # reads them as [1 + 3, B] from its start (contiguous, so that copy is the step's only one for them)
        self._inputs = torch.zeros(4 * largest, dtype=torch.int64, device=device)
        attn.init_cuda_graph(self.batch_sizes, max_seq_len)
        self._graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}  # (batch size, variant) -> graph
        self._outputs: dict[tuple[int, str], torch.Tensor] = {}  # [B, vocab] logits each graph writes
        self._last: dict[int, str] = {}  # batch size -> the variant its last prepared step runs

    @torch.inference_mode()
    def _body(self, size: int) -> torch.Tensor:
        """The decode step on the static buffers: ``[size, vocab]`` logits (every row is sampled)."""
        inputs = self.inputs(size)
        hidden = run_decoder(self.model, self.attn, inputs[0], inputs[1:], self.rope)
        return self.model.compute_logits(hidden)  # [size, vocab]

    def inputs(self, size: int) -> torch.Tensor:
        """The int64 ``[1 + 3, size]`` static inputs a size-``size`` graph reads: token ids, then M-RoPE positions."""
        return self._inputs[:4 * size].view(4, size)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def variants(self) -> dict[int, tuple[str, ...]]:
        """The variants captured per batch size (empty before :meth:`capture`)."""
        out: dict[int, tuple[str, ...]] = {}
        for size, variant in self._graphs:
            out[size] = out.get(size, ()) + (variant,)
        return out

    def capture(self) -> None:
        """Capture every batch size (each of the backend's variants), largest first, into one shared memory pool.

        Raises:
            ValueError: the model is not on a CUDA device.
        """
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {self.device}")
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):
            for variant in self.attn.graph_variants(size):
                self.attn.plan([_CAPTURE_SEQ], graph_batch_size=size, graph_variant=variant)
                graph = torch.cuda.CUDAGraph()  # two eager runs first, then captured into the shared pool
                self._outputs[size, variant] = capture(graph, lambda size=size: self._body(size), self.device,
                                                       pool=pool, warmups=2)
                self._graphs[size, variant] = graph
        torch.cuda.synchronize(self.device)

    def graph_size(self, num_seqs: int) -> int | None:
        """The captured size a step of ``num_seqs`` sequences replays, or ``None`` when none fits."""
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def serves(self, seqs: Sequence[tuple[int, int, Sequence[int]]]) -> bool:
        """True when a step of these sequences can replay a graph: all decode, a size fits, short enough."""
        return (bool(seqs) and self.graph_size(len(seqs)) is not None
                and all(new == 1 and cached + 1 <= self.max_seq_len for cached, new, _ in seqs))

    def _prepare(self, seqs, input_ids: torch.Tensor, positions: torch.Tensor, fed=None) -> tuple[int, str]:
        n = len(seqs)
        size = self.graph_size(n)
        if size is None or not self.serves(seqs):
            raise ValueError(f"no captured decode graph serves {n} sequences (sizes {list(self.batch_sizes)}, "
                             f"max_seq_len {self.max_seq_len})")
        if input_ids.shape != (n,) or positions.shape != (3, n):
            raise ValueError(f"expected input_ids [{n}] and positions [3, {n}], got {list(input_ids.shape)} "
                             f"and {list(positions.shape)}")
        variant = self.attn.graph_variant(seqs, size)
        self.attn.plan(seqs, graph_batch_size=size, graph_variant=variant)
        self._last[size] = variant
        host = torch.zeros((4, size), dtype=torch.int64)  # padding rows: token 0 at position 0
        host[0, :n] = input_ids
        host[1:, :n] = positions
        inputs = self.inputs(size)
        write_to(inputs, host)  # one queued copy
        if fed is not None:  # rows whose token is still on the device (async scheduling)
            feed(inputs[0], fed)
        return size, variant

    def run(self, seqs, input_ids: torch.Tensor, positions: torch.Tensor, fed=None, copy: bool = True) -> torch.Tensor:
        """Replay the graph for a decode step.

        Args:
            seqs: ``(cached, 1, block_ids)`` per sequence, in row order.
            input_ids: int64 ``[n]`` (host): each sequence's last token; positions: int64 ``[3, n]`` (host).
            fed: ``(rows, tokens)`` on the device: tokens that replace ``input_ids`` at those rows
                (:func:`~unifiedserve.engine.runner.feed`).
            copy: return a fresh tensor; False: a view of the graph's output buffer, which the next replay of this
                graph rewrites (the engine samples a step's logits before it launches the next: one copy of
                ``[n, vocab]`` fewer per step).

        Returns:
            ``[n, vocab]`` logits.

        Raises:
            ValueError: no captured graph serves the step (see :meth:`serves`) or shapes disagree.
            RuntimeError: :meth:`capture` has not run.
        """
        if not self.captured:
            raise RuntimeError("DecodeGraphs.run before capture()")
        key = self._prepare(seqs, input_ids, positions, fed)
        self._graphs[key].replay()
        logits = self._outputs[key][:len(seqs)]
        return logits.clone() if copy else logits

    def graph_for(self, num_seqs: int) -> torch.cuda.CUDAGraph:
        """The captured graph a ``num_seqs``-sequence step replays (benchmarks time or profile its ``replay()``,
        which reruns the last step prepared; see :meth:`replay_seconds`): the variant of the last step prepared at
        that size, else the first captured.

        Raises:
            ValueError: no captured graph serves ``num_seqs``; RuntimeError: not captured.
        """
        if not self.captured:
            raise RuntimeError("DecodeGraphs used before capture()")
        size = self.graph_size(num_seqs)
        if size is None:
            raise ValueError(f"no captured decode graph serves {num_seqs} sequences (sizes {list(self.batch_sizes)})")
        return self._graphs[size, self._last.get(size, self.variants()[size][0])]

    def replay_seconds(self, num_seqs: int, repeats: int = 20) -> float:
        """Device time of one replay of the graph a ``num_seqs``-sequence step uses: ``repeats`` replays back
        to back between two CUDA events, no host work between them (benchmarks: a step's wall time minus
        this is its host overhead). It replays on the buffers and attention metadata of the last step
        prepared, rewriting its logits and the K/V slot of its new tokens with the same values.

        Raises:
            ValueError: no captured graph serves ``num_seqs``; RuntimeError: not captured.
        """
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        graph = self.graph_for(num_seqs)
        graph.replay()  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0 / repeats

    def run_eager(self, seqs, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The same step as :meth:`run`, the same kernels launched one by one (to check replay against)."""
        size, _ = self._prepare(seqs, input_ids, positions)
        return self._body(size)[:len(seqs)].clone()
