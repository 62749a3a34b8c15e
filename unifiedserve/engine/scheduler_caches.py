"""Admission through the caches: what of a request the prefix cache (KV blocks by content hash) and the media
cache (visual tokens by media key) hold, taking it at admission, and caching a finished request's outputs.

The rules (a cached prefix cut back so that no media it covers only partly lacks a media-cache entry, media wholly
inside it skipped, a text-only prefix matched again when the request takes its KV) are in
:mod:`unifiedserve.engine.scheduler`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

from unifiedserve.engine.request import Request


class CacheAdmission:
    """:class:`~unifiedserve.engine.scheduler.Scheduler`'s prefix- and media-cache admission. Mixed into it: they use
    its ``blocks``, ``media_cache``, ``running``, ``visual_pages`` and cache counters (``prefix_queried_tokens``,
    ``prefix_hit_tokens``, ``media_queried_tokens``, ``media_hit_tokens``), and its page, prefill and overtake rules
    (``_pages_short``, ``_prefill_size``, ``_passed_too_often``, ``_pass``)."""

    def _use_caches(self, req: Request) -> tuple[int, list[int], set[int], set[int], int]:
        """What of ``req`` the caches hold: ``(cached tokens, their blocks, skipped media, media-cache
        media, covered encode items)``.

        Pins the media-cache entries it returns (undo with :meth:`_unpin` if the request is not
        admitted). The cached prefix always leaves the last prompt token to compute (its logits give
        the first output token). A media it covers only partly needs the rest of its visual tokens:
        from the media cache when it holds the media (the prefix may end anywhere in it, even inside
        an encode item: that item's copy starts at the prefix's end), else the whole media is decoded
        and encoded (the prefix is cut back to before it).
        """
        bs = self.blocks.block_size
        matched = self.blocks.match(req.block_hashes(bs)) if self.blocks.enable_prefix_caching else []
        n = min(len(matched) * bs, (req.prompt_len - 1) // bs * bs)
        pinned = set()
        if self.media_cache is not None and req.media_keys:
            pinned = {m for m in range(req.num_media) if req.media_keys[m] and self.media_cache.pin(req.media_keys[m])}
        media_spans = [(req.visual_positions[f], req.visual_positions[f + c - 1]) for f, c in req.media_visual_spans()]
        changed = True
        while changed:  # a partly covered media the media cache lacks: cut back to before it
            changed = False
            for m, (first, last) in enumerate(media_spans):
                if first < n <= last and m not in pinned:
                    n, changed = first // bs * bs, True
        skipped = {m for m, (_, last) in enumerate(media_spans) if last < n}
        for m in pinned & skipped:  # wholly inside the prefix: not needed after all
            self.media_cache.unpin(req.media_keys[m])
        covered = sum(1 for _, last in req.item_position_spans() if last < n)
        return n, matched[:n // bs], skipped, pinned - skipped, covered

    def _unpin(self, req: Request, media: set[int]) -> None:
        for m in media:
            self.media_cache.unpin(req.media_keys[m])

    def _admit_caches(self, req: Request, n: int, blocks: list[int], skipped: set[int], from_cache: set[int],
                      covered: int) -> None:
        """Take what :meth:`_use_caches` found: hold the cached blocks, skip the covered items."""
        self.blocks.allocate(req.request_id, n, cached_blocks=blocks)
        req.num_computed_tokens = req.num_cached_tokens = n
        req.skipped_media, req.cached_media, req.num_covered_items = skipped, from_cache, covered
        # of the first uncovered item, the visual tokens already in the prefix (only a copy can drop them)
        req.num_skipped_visual = self._skipped_visual(req, n, covered)
        req.ready_media.update(skipped | from_cache)
        req.num_scheduled_items = covered  # the covered items come first
        self.prefix_queried_tokens += req.prompt_len
        self.prefix_hit_tokens += n
        uncovered = [(i, item) for i, item in enumerate(req.encode_items) if i >= covered]
        self.media_queried_tokens += sum(item.num_visual_tokens for _, item in uncovered
                                         if req.media_keys and req.media_keys[item.media_index])
        self.media_hit_tokens += sum(item.num_visual_tokens for _, item in uncovered if item.media_index in from_cache)

    def _text_prefix(self, req: Request) -> list[int]:
        """The prefix cache's blocks of the text before ``req``'s first visual token, for a request that has
        computed nothing yet (its media are untouched by them); the last prompt token is always left to compute."""
        if not self.blocks.enable_prefix_caching or req.num_computed_tokens or req.num_covered_items:
            return []
        bs = self.blocks.block_size
        end = min(req.visual_positions[0] if req.num_visual_tokens else req.prompt_len, req.prompt_len - 1)
        return self.blocks.match(req.block_hashes(bs)[:end // bs])

    def _may_take_kv(self, req: Request, found: tuple) -> bool:
        """Whether a request being admitted with what the caches hold (:meth:`_use_caches`) may take all its KV now:
        the blocks and the visual pages its uncovered items need are free, and no admitted request waiting for its
        own KV has been passed too often. Those it passes count one more overtake, as in step 3."""
        n, cached_blocks, _, _, covered = found
        if not self.blocks.can_allocate(req.max_total_tokens, cached_blocks):
            return False
        skip = self._skipped_visual(req, n, covered)
        if self._pages_short(req, first=covered, skip=skip) > self.visual_pages.num_free_pages:  # as in step 3
            return False
        free = self.visual_pages.num_free_pages
        waiting = [r.request_id for r in self.running if not r.has_kv and self._prefill_size(r, 1) > 0
                   and (self._pages_short(r) > free or not self.blocks.can_append(r.request_id, r.max_total_tokens))]
        if self._passed_too_often(waiting):
            return False
        self._pass(waiting)
        return True

    @staticmethod
    def _skipped_visual(req: Request, n: int, covered: int) -> int:
        """Visual tokens of ``req``'s first uncovered item that lie in a cached prefix of ``n`` tokens covering its
        first ``covered`` items (only a copy from the media cache can leave them out)."""
        return req.visual_tokens_before(n) - sum(item.num_visual_tokens for item in req.encode_items[:covered])

    def _cache_outputs(self, req: Request, output_token_ids: Sequence[int] | None = None) -> None:
        """Register the full blocks a finished request's outputs filled (its prompt's are already in)."""
        if self.blocks.enable_prefix_caching and req.request_id in self.blocks:
            self.blocks.register(req.request_id, req.computed_block_hashes(self.blocks.block_size, output_token_ids))
