"""The engine's scheduler: encode budget, chunked prefill, continuous-batching decode.

Pure bookkeeping over request counters and integer block/page ids (no tensors). Each step it
returns one fully built :class:`SchedulerOutput`; the model runner executes it and the engine
commits the results with :meth:`Scheduler.commit`.

Within a step, following the paper's Algorithm 3: new requests are admitted once their patch
pages fit; vision encoding of admitted requests proceeds under the encode budget alpha (whole
images or single video slices, at least one per step, only of media whose patches are written)
even when prefill cannot run; prefill chunks fill the token budget tau, older requests first,
each stopping before the first visual token not yet encoded, and a request takes its KV blocks
(prompt + max_tokens) when its prefill starts (one whose cached prefix covers media, at admission:
see below); every request past its prompt decodes one token.

Who gets the budgets first (``SchedulerConfig.scheduling_policy``): ``fcfs``, the oldest request, as
above; ``srpt`` (default), the request with the fewest prompt tokens left to prefill, in whole prefill budgets
(shortest remaining processing time; within one budget, the oldest first), so a text question or an image is
not held behind a long video's encode and prefill.
srpt only shares out the amounts: each request takes at most its share in a first pass of the fcfs
loops and their rules, and a second pass gives what is left as fcfs would. Visual pages go by the rules
below whatever the policy; KV blocks too, except that a request srpt serves first may take its blocks
before an older one that could take them but got no share: that counts as one of the older one's
``max_kv_overtakes``. A request the srpt order left without a budget it could have used
``max_passed_steps`` times since it last ran goes first.

Caches (both optional). At admission a request takes the longest run of its prompt's leading KV
blocks that the prefix cache holds (content hashes, ``memory/prefix_hash.py``), cut back so that no
media is partly inside it; media wholly inside are neither decoded, encoded nor read
(``skipped_media``). Media whose visual tokens the media cache holds (by media key) are not
decoded either: their encode items are copies from the cache (``EncodeWork.from_cache``), free of
the encode budget. Computed full prompt blocks are registered in the prefix cache as prefill
commits them.

KV admission is fair without preemption: a request whose blocks do not fit yet is passed by later
requests whose blocks do (a 4-token question never waits behind streams that reserved the whole
cache), but only ``max_kv_overtakes`` times; after that nobody passes it, so freed blocks
accumulate for it and it cannot starve.

No request holds one resource while it waits forever for another. A request whose cached prefix
covers media takes the rest of its KV at admission or stays in the queue holding nothing (later
requests pass it, counted as above): two requests each holding part of their KV could each wait for
the other's blocks. A cached prefix of text only (a system prompt: with it cached, every request is
a hit) is matched again when the request takes its KV, and held from then with the rest. Visual pages,
which only prefill frees, go first to requests holding KV, by when they took it, then to the others in
admission order: each write leaves every request before it room for the rest of its items
(:meth:`Scheduler._pages_short`, in :mod:`~unifiedserve.engine.scheduler_steps`), and a request takes KV
only when the free pages let it finish encoding (else it waits as one whose blocks do not fit). So a KV
holder never waits for pages held by a request that waits for its KV (``tests/unifiedserve/engine/
test_scheduler_deadlock.py`` drives random workloads with late media to the end).

Two deployments drive it. In one process (:class:`unifiedserve.engine.LLM`) the runner writes an
admitted request's patches in the same step and decode runs here too. In the multi-process
runtime the vision process writes patches into the pages named at admission and reports each
media ready (:meth:`Scheduler.mark_media_ready`), and a request whose prefill is done is handed
off to the decode process (:meth:`Scheduler.hand_off`), keeping its KV blocks until
:meth:`Scheduler.release` . The decode process runs a decode-only scheduler
(:meth:`Scheduler.decode_only`): it adopts those requests (:meth:`Scheduler.adopt`) with the blocks
core lent them, schedules nothing but their decode rows, and never allocates or frees a block.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

from unifiedserve.engine.request import Request, Status
from unifiedserve.engine.scheduler_caches import CacheAdmission
from unifiedserve.engine.scheduler_shares import BudgetShares
from unifiedserve.engine.scheduler_steps import EncodePrefillSteps
from unifiedserve.engine.scheduler_types import (GPU_TOKEN_BUDGETS, SCHEDULING_POLICIES, EncodeWork,
                                                MediaCacheIndex, PrefillChunk, SchedulerConfig, SchedulerOutput,
                                                server_token_budgets)
from unifiedserve.memory.block_manager import BlockManager
from unifiedserve.memory.pages import PageAllocator, PagedStream, can_plan_write, plan_write

__all__ = ["GPU_TOKEN_BUDGETS", "SCHEDULING_POLICIES", "EncodeWork", "MediaCacheIndex", "PrefillChunk", "Scheduler",
           "SchedulerConfig", "SchedulerOutput", "server_token_budgets"]


class Scheduler(BudgetShares, CacheAdmission, EncodePrefillSteps):
    """Owns request state and the allocators' policy (who gets KV blocks and patch/visual pages).

    Built without allocators (:meth:`decode_only`) it only decodes requests prefilled elsewhere. The srpt
    budget shares and overtake counts (:mod:`~unifiedserve.engine.scheduler_shares`), the cache admission
    (:mod:`~unifiedserve.engine.scheduler_caches`), and the encode and prefill steps with their page and KV rules
    (:mod:`~unifiedserve.engine.scheduler_steps`) are mixins of their own modules.
    """

    def __init__(self, config: SchedulerConfig, blocks: BlockManager | None, patch_pages: PageAllocator | None,
                 visual_pages: PageAllocator | None, media_cache: MediaCacheIndex | None = None):
        self.config = config
        #: the decode process's mode: only adopted requests, only decode rows, no allocator
        self.is_decode_only = blocks is None
        self.media_cache = media_cache
        #: cache counters, in prompt tokens: asked of the prefix cache and found; visual tokens asked
        #: of the media cache and found (media the prefix cache already covered are not asked)
        self.prefix_queried_tokens = self.prefix_hit_tokens = 0
        self.media_queried_tokens = self.media_hit_tokens = 0
        self.blocks = blocks
        self.patch_pages = patch_pages
        self.visual_pages = visual_pages
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self.patch_streams: dict[str, PagedStream] = {}
        self.visual_streams: dict[str, PagedStream] = {}
        self.handed_off: dict[str, Request] = {}  # prefilled, decoding elsewhere; their KV blocks are still held
        self.kv_overtakes: dict[str, int] = {}  # request waiting for KV blocks -> later requests that took theirs
        self.passed_steps: dict[str, int] = {}  # srpt: request -> steps it was left without budget since it ran
        self.adopted: set[str] = set()  # prefilled elsewhere, decoding here on blocks lent by their owner
        self._kv_grants = itertools.count()  # Request.kv_order: holders take visual pages in this order

    @classmethod
    def decode_only(cls, config: SchedulerConfig) -> Scheduler:
        """A scheduler for the decode process: it adopts prefilled requests and schedules their decode rows."""
        return cls(config, None, None, None)

    @property
    def num_waiting(self) -> int:
        """Requests whose prefill has not started: not admitted yet, or admitted without KV blocks."""
        return len(self.waiting) + sum(1 for r in self.running if not r.has_kv)

    def add(self, request: Request) -> None:
        """Queue ``request`` (ValueError, and nothing queued, if it can never run: see :meth:`check`)."""
        if self.is_decode_only:
            raise ValueError("a decode-only scheduler takes prefilled requests (adopt), not new ones")
        self.check(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """Raise ValueError if ``request`` can never run here: a duplicate id, an empty prompt, more KV or patch
        rows than the whole pools hold, or an encode item whose visual tokens the visual buffer cannot hold at
        once (an item is written whole, maybe after the partly read last page of the one before it)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.prompt_len == 0:
            raise ValueError("the prompt is empty: it needs at least one token")
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if capacity < request.max_total_tokens:
            raise ValueError(f"the request needs {request.max_total_tokens} tokens of KV cache (prompt + max_tokens), "
                             f"more than the whole cache holds ({capacity}); lower max_tokens, or give the server a "
                             f"larger --kv-cache-gb")
        rows = self.patch_pages.num_pages * self.patch_pages.page_size
        if rows < request.num_patch_tokens:
            raise ValueError(f"the request's media make {request.num_patch_tokens} patch rows, more than the patch "
                             f"buffer holds ({rows}); send smaller media (max_pixels, fps, max_frames) or give the "
                             f"server a larger --patch-buffer-gb")
        page = self.visual_pages.page_size
        largest = max((item.num_visual_tokens for item in request.encode_items), default=0)
        if largest and -(-(largest + page - 1) // page) > self.visual_pages.num_pages:
            raise ValueError(f"one of the request's media items makes {largest} visual tokens, more than the visual "
                             f"buffer holds at once ({self.visual_pages.num_pages * page - page + 1}); send smaller "
                             f"media (max_pixels) or give the server a larger --visual-buffer-gb")

    def adopt(self, request: Request) -> None:
        """Decode ``request`` here: its prompt was prefilled elsewhere (its first output token is there).

        Its KV blocks are borrowed: the runner has the block table, and :meth:`finish` gives nothing
        back (the lender frees them, e.g. core on ``ReleaseBlocks``). Decode rows go to the running
        requests in adoption order, ``max_decode_batch`` at most per step.

        Raises:
            ValueError: a duplicate id, or no first token.
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.output_token_ids:
            raise ValueError(f"request {request.request_id!r} is adopted without its first token")
        request.num_computed_tokens = request.prompt_len
        request.status, request.has_kv = Status.RUNNING, True
        self.requests[request.request_id] = request
        self.running.append(request)
        self.adopted.add(request.request_id)

    @property
    def ingesting(self) -> bool:
        """Whether vision is still writing the media of an admitted request (decoding it now)."""
        return any(len(r.ready_media) < r.num_media for r in self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_decode_rows(self) -> list[str]:
        """The decode rows the next :meth:`schedule` gives, as things stand (read-only)."""
        return self._decode_rows()

    def _decode_rows(self) -> list[str]:
        """The requests past their prompt that decode this step: the oldest ``max_decode_batch``."""
        rows = [r.request_id for r in self.running if r.is_prefill_done and r.output_token_ids]
        return rows[:self.config.max_decode_batch]

    def mark_media_ready(self, request_id: str, media_index: int, num_rows: int | None = None) -> bool:
        """The patches of media ``media_index`` are in the buffer: its encode items may run.

        ``num_rows`` (streaming ingest): only its first ``num_rows`` patch rows are; the items they
        cover may run. None (or the media's whole row count): all of them.

        Returns False (and does nothing) for a request that is no longer here (finished, aborted).
        """
        req = self.requests.get(request_id)
        if req is None:
            return False
        if not 0 <= media_index < req.num_media:
            raise ValueError(f"request {request_id!r} has {req.num_media} media, not {media_index + 1}")
        if num_rows is None or num_rows >= req.media_patch_rows(media_index):
            req.ready_media.add(media_index)
            req.ready_rows.pop(media_index, None)
        else:
            req.ready_rows[media_index] = max(req.ready_rows.get(media_index, 0), num_rows)
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.is_decode_only:
            out.decode = self._decode_rows()
            return out
        # 1. admit new requests (FIFO) while their patch pages fit: their vision work can start
        #    now; KV blocks are only needed when their prefill starts (step 3). A request that holds
        #    cached prefix blocks from now on takes the rest of its KV now too, or waits in the queue
        #    holding nothing (holding part of its KV while waiting for the rest, two such requests
        #    could each wait for blocks the other holds, with nothing running to free any); later
        #    requests pass it, at most max_kv_overtakes of them
        admitted_writes, passed, index = [], [], 0
        while index < len(self.waiting) and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[index]
            found = self._use_caches(req)
            if found[1] and not (found[2] or found[4]):
                # its cached prefix holds text only (a system prompt): matched again when its KV is taken, held
                # with the rest of it then (:meth:`_take_kv`), so it holds no KV while its media are decoded
                found = (0, [], set(), found[3], 0)
            req.skipped_media, req.cached_media, req.num_covered_items = found[2], found[3], found[4]
            rows = req.num_patch_rows_needed  # sized by what the caches hold
            stream = PagedStream(req.request_id, self.patch_pages.page_size, rows)
            writes = admitted_writes + ([(stream, rows)] if rows else [])
            fits = can_plan_write(writes, self.patch_pages) and not self._passed_too_often(passed)
            if not fits or (found[1] and not self._may_take_kv(req, found)):
                self._unpin(req, found[3])
                req.skipped_media, req.cached_media, req.num_covered_items = set(), set(), 0
                if not fits or self._passed_too_often([req.request_id]):
                    break
                passed.append(req.request_id)
                index += 1
                continue
            del self.waiting[index]
            self._pass(passed)
            self._admit_caches(req, *found)
            if found[1]:
                self.kv_overtakes.pop(req.request_id, None)
                self._take_kv(req, out)
            req.status = Status.RUNNING
            self.running.append(req)
            out.admitted.append(req.request_id)
            if req.media_without_patches:
                out.skip_media[req.request_id] = sorted(req.media_without_patches)
            self.patch_streams[req.request_id] = stream
            self.visual_streams[req.request_id] = PagedStream(req.request_id, self.visual_pages.page_size,
                                                              req.num_visual_rows_needed)
            if self.config.patches_ready_on_admit:
                req.ready_media.update(range(req.num_media))
            admitted_writes = writes
        if admitted_writes:
            out.patch_write = plan_write(admitted_writes, self.patch_pages)
        # 2. vision encoding under its budget, in page-priority order: requests holding KV blocks by
        #    when they took them, then the others in admission order; it proceeds even when prefill
        #    cannot (waiting for KV blocks or on earlier slices). A write leaves every request before
        #    it room for the rest of its items (counting the pages that request's own reads will
        #    free): visual pages are freed only by prefill, so a request without KV that took the room
        #    a KV holder needs would wait for that holder's KV, and neither would move
        # 3. prefill chunks under the token budget, in admission order; a chunk stops before the first
        #    visual token that is not encoded yet (this step's encodes run first)
        # srpt: both budgets are first shared out in srpt order (:meth:`_by_remaining`), each request taking
        # at most its share in a first pass of the same order and rules; a second pass gives what is left as
        # fcfs would. Only the amounts change: pages and KV blocks go by the rules above (an srpt order there
        # could let a short request wait for pages a long one holds while the long one may not pass it to KV)
        srpt = self.config.scheduling_policy == "srpt"
        passed: set[str] = set()  # srpt: requests that could have used a budget the srpt order left nothing of
        order = self._by_remaining(self.running) if srpt else []  # (encodes do not change it: one sort a step)
        self._schedule_encode(out, self._encode_shares(order, passed) if srpt else None)
        self._schedule_prefill(out, self._prefill_shares(order, passed) if srpt else None)
        if srpt:  # passed over max_passed_steps times since it last ran: it goes first
            ran = {w.request_id for w in out.encode} | {c.request_id for c in out.prefill}
            for rid in passed - ran:
                self.passed_steps[rid] = self.passed_steps.get(rid, 0) + 1
            for rid in ran:
                self.passed_steps.pop(rid, None)
        # 4. every request past its prompt decodes one token (up to max_decode_batch of them)
        out.decode = self._decode_rows()
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """Record that the step ran: advance prefill progress and free the pages its reads consumed.

        Output tokens are appended by the engine. Call exactly once per :meth:`schedule`, after the
        runner has executed the step (its gathers read the pages freed here).
        """
        if self.is_decode_only:
            return  # decode rows only: no prompt progress, no pages
        bs = self.blocks.block_size
        for chunk in out.prefill:
            req = self.requests.get(chunk.request_id)
            if req is not None:  # not finished in between (abort)
                req.num_computed_tokens += chunk.num_tokens
                if self.blocks.enable_prefix_caching:  # its full, computed prompt blocks join the cache
                    self.blocks.register(req.request_id, req.block_hashes(bs)[:req.num_computed_tokens // bs])
        self.patch_pages.free(out.freed_patch_pages)
        self.visual_pages.free(out.freed_visual_pages)
        for key in out.unpin_media_keys:
            self.media_cache.unpin(key)

    @staticmethod
    def _media_copied(req: Request, media: int) -> bool:
        """Whether every item of ``media`` has been scheduled (its pin is dropped at that step's commit)."""
        return all(i < req.num_scheduled_items for i, item in enumerate(req.encode_items) if item.media_index == media)

    def hand_off(self, request_id: str) -> Request:
        """A prefilled request leaves for the decode process; it keeps its KV blocks until :meth:`release`."""
        req = self.requests.pop(request_id)
        if not req.is_prefill_done:
            raise ValueError(f"request {request_id!r} is handed off before its prefill is done")
        self.running.remove(req)
        self.patch_pages.free(self.patch_streams.pop(request_id).release())
        self.visual_pages.free(self.visual_streams.pop(request_id).release())
        self.handed_off[request_id] = req
        return req

    def release(self, request_id: str, output_token_ids: Sequence[int] = ()) -> bool:
        """The decode process is done with a handed-off request: free its KV blocks.

        With prefix caching, the full blocks its outputs filled join the cache first (``output_token_ids``:
        its outputs as the decode process reports them, aborted requests' too; none given caches none).

        Returns False for an id that is not handed off (e.g. released twice).
        """
        req = self.handed_off.pop(request_id, None)
        if req is None:
            return False
        self._cache_outputs(req, output_token_ids)
        self.blocks.free(request_id)
        return True

    def finish(self, request_id: str, reason: str) -> Request:
        """Mark finished (or aborted) and free everything it holds: KV blocks and unread pages."""
        req = self.requests.pop(request_id)
        self.kv_overtakes.pop(request_id, None)
        self.passed_steps.pop(request_id, None)
        req.status, req.finish_reason = Status.FINISHED, reason
        if request_id in self.adopted:  # its blocks are borrowed: the lender frees them
            self.adopted.remove(request_id)
            self.running.remove(req)
        elif req in self.running:
            self.running.remove(req)
            if request_id in self.blocks:
                self._cache_outputs(req)
                self.blocks.free(request_id)
            for m in req.cached_media:  # pins of media-cache entries not copied yet
                if not self._media_copied(req, m):
                    self.media_cache.unpin(req.media_keys[m])
            self.patch_pages.free(self.patch_streams.pop(request_id).release())
            self.visual_pages.free(self.visual_streams.pop(request_id).release())
        elif req in self.waiting:
            self.waiting.remove(req)
        return req
