"""A request as the engine sees it: prompt token ids, its vision inputs, and progress counters."""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from unifiedserve.engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted: holds no KV blocks or pages
    RUNNING = "running"  # admitted: encoding and/or prefilling, then decoding
    FINISHED = "finished"


@dataclass(frozen=True)
class EncodeItem:
    """One unit of vision encoding: a whole image, or one temporal slice of a video.

    Vision attention never crosses these units in Qwen2.5-VL, so encoding them separately is exact.
    """

    media_index: int  # which image/video of the request
    num_patch_tokens: int  # rows of 1176 patch values it reads
    num_visual_tokens: int  # rows of visual tokens it writes (patch tokens / merge^2)
    grid_thw: tuple[int, int, int]  # the unit's own grid: (1, h, w) for a video slice


@dataclass
class Request:
    """Progress of one request. Counters only; tensors live in the model runner."""

    request_id: str
    prompt_token_ids: list[int]  # placeholders already expanded to one token per visual token
    params: SamplingParams
    encode_items: list[EncodeItem] = field(default_factory=list)
    #: sorted prompt positions of the visual tokens, in encode order
    visual_positions: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # prompt tokens prefilled so far
    num_scheduled_items: int = 0  # items handed to the encoder; the runner encodes them before prefill
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    #: media whose patches are all written (or not needed); their encode items may be scheduled
    ready_media: set[int] = field(default_factory=set)
    #: streaming ingest: patch rows written so far of media still arriving (a prefix of whole items)
    ready_rows: dict[int, int] = field(default_factory=dict)
    #: one per media: its identity for the caches ("" = never cached); empty = none cacheable
    media_keys: list[str] = field(default_factory=list)
    #: prompt tokens whose KV came from the prefix cache (a whole number of blocks, set at admission)
    num_cached_tokens: int = 0
    #: media whose visual tokens all lie in the cached prefix: neither decoded, encoded nor read
    skipped_media: set[int] = field(default_factory=set)
    #: media whose visual tokens come from the media cache: not decoded; encoded by a copy
    cached_media: set[int] = field(default_factory=set)
    #: leading encode items whose visual tokens all lie in the cached prefix (never encoded or read)
    num_covered_items: int = 0
    #: visual tokens of the first uncovered item that lie in the cached prefix
    #: (copied from the media cache without them)
    num_skipped_visual: int = 0
    has_kv: bool = False  # KV blocks for prompt + max_tokens are allocated (prefill may run)
    kv_order: int = -1  # when it took them, among the scheduler's grants (who takes visual pages first)

    def __post_init__(self) -> None:
        visual = sum(item.num_visual_tokens for item in self.encode_items)
        if visual != len(self.visual_positions):
            raise ValueError(f"request {self.request_id}: {len(self.visual_positions)} visual placeholders in the "
                             f"prompt but its media produce {visual} visual tokens")
        if self.media_keys and len(self.media_keys) != self.num_media:
            raise ValueError(f"request {self.request_id}: {len(self.media_keys)} media keys for {self.num_media} media")
        self._block_hashes: list[bytes] | None = None
        self._pages_memo: tuple[tuple, int] | None = None  # most_visual_pages' last (arguments, answer)
        # per item: patch rows of its media up to and including it (streaming readiness)
        # and per item: the offset of its first visual token within its media's
        self._item_row_end, self._item_visual_offset, rows, visual, last = [], [], 0, 0, -1
        for item in self.encode_items:
            if item.media_index != last:
                rows = visual = 0
            rows += item.num_patch_tokens
            self._item_visual_offset.append(visual)
            visual += item.num_visual_tokens
            last = item.media_index
            self._item_row_end.append(rows)

    @property
    def num_media(self) -> int:
        return 1 + max((item.media_index for item in self.encode_items), default=-1)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_patch_tokens(self) -> int:
        return sum(item.num_patch_tokens for item in self.encode_items)

    @property
    def num_visual_tokens(self) -> int:
        return len(self.visual_positions)

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.prompt_len

    def media_patch_rows(self, media: int) -> int:
        """Patch rows of media ``media`` (the row count at its last item)."""
        return max((end for item, end in zip(self.encode_items, self._item_row_end) if item.media_index == media),
                   default=0)

    def item_ready(self, index: int) -> bool:
        """Whether encode item ``index``'s patches are in the buffer (or not needed)."""
        media = self.encode_items[index].media_index
        return media in self.ready_media or self.ready_rows.get(media, 0) >= self._item_row_end[index]

    def item_visual_range(self, index: int) -> tuple[int, int]:
        """Encode item ``index``'s visual tokens as ``[start, end)`` within its media's."""
        start = self._item_visual_offset[index]
        return start, start + self.encode_items[index].num_visual_tokens

    def is_last_item_of_media(self, index: int) -> bool:
        items = self.encode_items
        return index + 1 == len(items) or items[index + 1].media_index != items[index].media_index

    def media_visual_spans(self) -> list[tuple[int, int]]:
        """Per media: ``(first, count)`` of its visual tokens in ``visual_positions``."""
        spans = [[0, 0] for _ in range(self.num_media)]
        first = 0
        for item in self.encode_items:
            span = spans[item.media_index]
            if not span[1]:
                span[0] = first
            span[1] += item.num_visual_tokens
            first += item.num_visual_tokens
        return [tuple(s) for s in spans]

    def _media_hash_spans(self) -> list[tuple[int, int, str]]:
        keys = self.media_keys or [""] * self.num_media
        return [(f, n, k) for (f, n), k in zip(self.media_visual_spans(), keys)]

    def most_visual_pages(self, first: int, offset: int, covered: int, skip: int, page: int) -> int:
        """The most pages of ``page`` rows this request holds at once writing its encode items from ``first`` on,
        starting ``offset`` rows into a page: an item's pages, the partly written page before it included (the
        item at ``covered`` writes ``skip`` rows fewer). The scheduler asks it every step for each request still
        encoding, with the same arguments until the request writes: the last answer is kept (a 768-frame video's
        384 items took 47 us a walk)."""
        key = (first, offset, covered, skip, page)
        if self._pages_memo is None or self._pages_memo[0] != key:
            most = 0
            for index in range(first, len(self.encode_items)):
                rows = self.encode_items[index].num_visual_tokens - (skip if index == covered else 0)
                most = max(most, -(-(offset + rows) // page))
                offset = (offset + rows) % page
            self._pages_memo = (key, most)
        return self._pages_memo[1]

    def block_hashes(self, block_size: int) -> list[bytes]:
        """Prefix hashes of the prompt's full KV blocks (computed once; see ``memory/prefix_hash.py``)."""
        if self._block_hashes is None:
            from unifiedserve.memory.prefix_hash import block_hashes

            self._block_hashes = block_hashes(self.prompt_token_ids, block_size, self._media_hash_spans(),
                                              self.visual_positions)
        return self._block_hashes

    def computed_block_hashes(self, block_size: int, output_token_ids: Sequence[int] | None = None) -> list[bytes]:
        """Prefix hashes of every full block whose K/V are written: the prompt's computed blocks, then, once
        decoding, the blocks its outputs filled, as vLLM caches them (a later turn that repeats the answer
        finds it). The last output's K/V are never computed (nothing ran on it), so it is left out.

        Args:
            output_token_ids: the outputs, where this process does not hold them (a decode process reports
                them with its ``ReleaseBlocks``); default ``self.output_token_ids``.
        """
        outputs = self.output_token_ids if output_token_ids is None else output_token_ids
        prompt = self.block_hashes(block_size)
        if not outputs or self.num_computed_tokens < self.prompt_len:
            return prompt[:self.num_computed_tokens // block_size]
        if len(prompt) < self.prompt_len // block_size:  # the chain stopped at media without a key
            return prompt
        from unifiedserve.memory.prefix_hash import block_hashes

        tokens = [*self.prompt_token_ids, *outputs[:-1]]
        return block_hashes(tokens, block_size, self._media_hash_spans(), self.visual_positions, start=prompt)

    @property
    def media_without_patches(self) -> set[int]:
        """Media the patch buffer never holds for this request (cached prefix or media cache)."""
        return self.skipped_media | self.cached_media

    @property
    def num_patch_rows_needed(self) -> int:
        """Patch rows this request writes into the patch buffer (its media minus the cached ones)."""
        skip = self.media_without_patches
        return sum(i.num_patch_tokens for i in self.encode_items if i.media_index not in skip)

    @property
    def num_visual_rows_needed(self) -> int:
        """Visual-token rows this request writes into the visual buffer (its items past the cached prefix)."""
        return sum(i.num_visual_tokens for i in self.encode_items[self.num_covered_items:]) - self.num_skipped_visual

    def skipped_visual_of(self, index: int) -> int:
        """Visual tokens of encode item ``index`` that the cached prefix holds (not written: only the first
        uncovered item can have any)."""
        return self.num_skipped_visual if index == self.num_covered_items else 0

    def item_position_spans(self) -> list[tuple[int, int]]:
        """Per encode item: the prompt positions of its first and last visual token."""
        spans, first = [], 0
        for item in self.encode_items:
            spans.append((self.visual_positions[first], self.visual_positions[first + item.num_visual_tokens - 1]))
            first += item.num_visual_tokens
        return spans

    def visual_tokens_before(self, position: int) -> int:
        """How many visual tokens sit at prompt positions < ``position``."""
        return bisect.bisect_left(self.visual_positions, position)

    @property
    def max_total_tokens(self) -> int:
        return self.prompt_len + self.params.max_tokens
