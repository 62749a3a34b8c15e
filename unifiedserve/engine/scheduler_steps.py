"""Steps 2 and 3 of a schedule: the encode items with their patch reads and visual-page writes, the prefill
chunks with their visual-token reads, and the page and KV rules they follow (who may take visual pages and in
what order, how many pages a request is short, when a request may take its KV blocks, how much of a prompt is
ready to prefill). Step 1 (admission) and the srpt shares use these rules too. The steps themselves are described
in :mod:`unifiedserve.engine.scheduler`'s docstring and :meth:`~unifiedserve.engine.scheduler.Scheduler.schedule`.
"""

from __future__ import annotations

from unifiedserve.engine.request import Request
from unifiedserve.engine.scheduler_types import EncodeWork, PrefillChunk, SchedulerOutput
from unifiedserve.memory.pages import plan_read, plan_write


class EncodePrefillSteps:
    """:class:`~unifiedserve.engine.scheduler.Scheduler`'s encode and prefill steps and its page and KV rules. Mixed
    into it: they use its ``config``, ``running``, ``blocks``, ``patch_pages``, ``visual_pages``, ``patch_streams``,
    ``visual_streams``, ``kv_overtakes``, ``prefix_hit_tokens`` and ``_kv_grants``, its overtake counts
    (``_passed_too_often``, ``_pass``) and its cached text prefix (``_text_prefix``)."""

    def _schedule_encode(self, out: SchedulerOutput, shares: dict[str, int] | None) -> None:
        """Step 2: the encode items, their patch reads and visual-page writes (``shares``: srpt's first pass)."""
        order = self._page_priority()
        works: dict[str, list[EncodeWork]] = {r.request_id: [] for r in order}
        n_patch, n_visual = dict.fromkeys(works, 0), dict.fromkeys(works, 0)
        encode_tokens = 0
        for limits in ([shares, None] if shares is not None else [None]):
            # pages the writes so far allocate
            new_pages = sum(self.visual_streams[rid].num_pages_to_write(n) for rid, n in n_visual.items() if n)
            reserve = -1  # the most free pages any request before this one needs kept (:meth:`_pages_short`)
            for req in order:
                rid = req.request_id
                stream = self.visual_streams[rid]
                share = None if limits is None else limits.get(rid, 0)
                mine = stream.num_pages_to_write(n_visual[rid]) if n_visual[rid] else 0  # counted in new_pages
                while req.num_scheduled_items < len(req.encode_items):
                    index = req.num_scheduled_items
                    item = req.encode_items[index]
                    cached = item.media_index in req.cached_media
                    if not cached and (encode_tokens >= self.config.encode_token_budget if share is None
                                       else n_patch[rid] >= share):
                        break
                    if not req.item_ready(index):
                        break
                    drop = req.skipped_visual_of(index)
                    rows = n_visual[rid] + item.num_visual_tokens - drop
                    free = self.visual_pages.num_free_pages - (new_pages - mine) - stream.num_pages_to_write(rows)
                    if free < 0 or free < reserve:
                        break
                    works[rid].append(EncodeWork(rid, index, from_cache=cached, skip_visual=drop))
                    req.num_scheduled_items += 1
                    n_visual[rid] = rows
                    if cached:  # a copy: free of the encode budget, reads no patches
                        if req.is_last_item_of_media(index):
                            out.unpin_media_keys.append(req.media_keys[item.media_index])
                        continue
                    encode_tokens += item.num_patch_tokens
                    n_patch[rid] += item.num_patch_tokens
                if n_visual[rid]:
                    new_pages += stream.num_pages_to_write(n_visual[rid]) - mine
                reserve = max(reserve, self._pages_short(req, n_visual[rid]))
        reads, writes = [], []
        for req in order:  # each request's items together, in the order of its reads and writes
            rid = req.request_id
            out.encode.extend(works[rid])
            if n_patch[rid]:
                reads.append((self.patch_streams[rid], n_patch[rid]))
            if n_visual[rid]:
                writes.append((self.visual_streams[rid], n_visual[rid]))
        if reads:
            out.patch_read, out.freed_patch_pages = plan_read(reads, self.patch_pages.page_size)
        if writes:
            out.visual_write = plan_write(writes, self.visual_pages)

    def _schedule_prefill(self, out: SchedulerOutput, shares: dict[str, int] | None) -> None:
        """Step 3: the prefill chunks and their visual-token reads (``shares``: srpt's first pass)."""
        budget, sizes = self.config.prefill_token_budget, {}
        for limits in ([shares, None] if shares is not None else [None]):
            blocked = []
            for req in self.running:
                rid = req.request_id
                if req.is_prefill_done or budget <= 0:
                    continue
                done = sizes.get(rid, 0)
                possible = self._prefill_size(req, done + budget) - done
                if possible <= 0:
                    continue
                if possible > budget and sizes and limits is None and shares is not None:
                    continue  # srpt, chunking off: a whole prompt past what is left waits for its own step (and KV)
                limit = budget if limits is None else min(budget, limits.get(rid, 0))
                if not req.has_kv:
                    # KV blocks for prompt + max_tokens (after its cached prefix's), in admission order; a
                    # request that does not fit yet may be passed by one that does, unless an earlier one
                    # was passed too often. One whose remaining items the free visual pages cannot take
                    # (after its own reads) waits without KV: it would hold KV waiting for pages others hold
                    text_prefix = self._text_prefix(req)
                    if not self._kv_fits(req, text_prefix):
                        blocked.append(rid)
                        continue
                    if self._passed_too_often(blocked):
                        continue
                    if limit <= 0:  # srpt gave it no share: a later request that takes KV now passes it (counted)
                        blocked.append(rid)
                        continue
                    self._pass(blocked)
                    self.kv_overtakes.pop(rid, None)
                    self._take_kv(req, out, text_prefix)  # (past its cached text, if any: computed tokens move)
                size = self._prefill_size(req, done + limit) - done if limit > 0 else 0
                if size <= 0:
                    continue
                sizes[rid] = done + size
                budget -= size
        visual_reads = []
        for req in self.running:  # admission order
            size = sizes.get(req.request_id)
            if not size:
                continue
            start = req.num_computed_tokens
            out.prefill.append(PrefillChunk(req.request_id, start, size, is_last=start + size == req.prompt_len))
            n_visual = req.visual_tokens_before(start + size) - req.visual_tokens_before(start)
            if n_visual:
                visual_reads.append((self.visual_streams[req.request_id], n_visual))
        if visual_reads:
            out.visual_read, out.freed_visual_pages = plan_read(visual_reads, self.visual_pages.page_size)

    def _kv_fits(self, req: Request, text_prefix: list[int]) -> bool:
        """Whether ``req`` (holding no KV) may take its KV blocks now as far as room goes: the blocks are free (after
        its cached ``text_prefix``), and so are the visual pages the rest of its items need (after its own reads)."""
        return self._pages_short(req) <= self.visual_pages.num_free_pages \
            and self.blocks.can_allocate(req.max_total_tokens, text_prefix)

    def _take_kv(self, req: Request, out: SchedulerOutput, text_prefix: list[int] = ()) -> None:
        """Give ``req`` its KV blocks for prompt + max_tokens (it holds its cached prefix's already), starting with
        ``text_prefix``: cached blocks of its leading text (:meth:`_text_prefix`), which it then needs not compute."""
        if text_prefix:
            n = len(text_prefix) * self.blocks.block_size
            self.blocks.free(req.request_id)  # its empty table of admission
            self.blocks.allocate(req.request_id, n, cached_blocks=text_prefix)
            req.num_computed_tokens = req.num_cached_tokens = n
            self.prefix_hit_tokens += n
        self.blocks.append(req.request_id, req.max_total_tokens)
        req.has_kv, req.kv_order = True, next(self._kv_grants)
        out.block_tables[req.request_id] = self.blocks.block_table(req.request_id)

    def _page_priority(self) -> list[Request]:
        """Running requests in the order they may take visual pages: those holding KV blocks by when they took
        them, then the others in admission order."""
        holders = sorted((r for r in self.running if r.has_kv), key=lambda r: r.kv_order)
        return holders + [r for r in self.running if not r.has_kv]

    def _pages_short(self, req: Request, writing: int = 0, first: int | None = None, skip: int | None = None) -> int:
        """Free visual pages ``req`` needs to write the rest of its encode items, after it writes ``writing`` more
        rows this step: the most pages it holds at once writing them (an item's pages, plus the partly written
        page before it, which stays until it is read to its end), less the pages it holds now. (Its prefill reads,
        and frees, each item's pages before the next item needs room.) At most the free pages: it can finish
        encoding without anyone else's pages. ``first`` and ``skip``: the first item to write and the visual
        tokens of it the cached prefix covers, for a request not admitted yet (else its own)."""
        first = req.num_scheduled_items if first is None else first
        covered, skip = (req.num_covered_items, req.num_skipped_visual) if skip is None else (first, skip)
        if first >= len(req.encode_items):
            return -1
        page = self.visual_pages.page_size
        stream = self.visual_streams.get(req.request_id)
        written = writing + (stream.num_written_tokens if stream is not None else 0)
        held = (len(stream.pages) + stream.num_pages_to_write(writing)) if stream is not None else 0
        return req.most_visual_pages(first, written % page, covered, skip, page) - held

    def _prefill_size(self, req: Request, budget: int) -> int:
        start = req.num_computed_tokens
        encoded = sum(i.num_visual_tokens for i in req.encode_items[:req.num_scheduled_items])
        ready = (req.visual_positions[encoded] if encoded < req.num_visual_tokens else req.prompt_len) - start
        if not self.config.enable_chunked_prefill:
            # the whole prompt (past its cached prefix) in one step, once all of it is ready
            rest = req.prompt_len - req.num_cached_tokens
            return rest if start == req.num_cached_tokens and ready == rest else 0
        return min(ready, budget)
