"""Who goes first in a step: the srpt policy's budget shares and the KV overtake counts.

Under ``scheduling_policy="srpt"`` the encode and prefill budgets are first shared out in srpt order
(:meth:`BudgetShares._by_remaining`); the scheduler's encode and prefill loops give each request at most its share
in a first pass, then what is left as fcfs would. The overtake counts (``max_kv_overtakes``) bound, whatever the
policy, how often later requests may take KV blocks or a seat before a waiting request. The rules themselves are
in :mod:`unifiedserve.engine.scheduler`'s docstring.
"""

from __future__ import annotations

from unifiedserve.engine.request import Request


class BudgetShares:
    """:class:`~unifiedserve.engine.scheduler.Scheduler`'s srpt shares and overtake counts. Mixed into it: they use
    its ``config``, ``running``, ``passed_steps``, ``kv_overtakes``, ``visual_pages`` and ``visual_streams``, and its
    page and prefill rules (``_page_priority``, ``_pages_short``, ``_prefill_size``, ``_kv_fits``, ``_text_prefix``)."""

    def _by_remaining(self, requests) -> list[Request]:
        """``requests`` in srpt order: those passed over ``max_passed_steps`` times first (oldest first), then
        the fewest prompt tokens left to prefill (encoded or not), counted in whole prefill budgets; a tie, the
        oldest first. Counted in tokens, a request one token longer than a later one waited for it: on the H200
        (2026-11-28) 64 videos of 23,088-23,098 tokens were served by their last digits, and one waited 21.8 s
        while later ones took 2.7 s, until max_passed_steps let it go first. Two sizes either side of a multiple
        of the budget are still ordered, by one budget's worth at most; max_passed_steps bounds that wait too."""
        budget = self.config.prefill_token_budget

        def key(req: Request) -> tuple[bool, int]:
            overdue = self.passed_steps.get(req.request_id, 0) >= self.config.max_passed_steps
            return not overdue, 0 if overdue else -(-(req.prompt_len - req.num_computed_tokens) // budget)

        return sorted(requests, key=key)  # stable: admission order within a key

    def _encode_shares(self, order: list[Request], passed: set[str]) -> dict[str, int]:
        """srpt: the patch tokens each request may encode this step: the budget given in ``order``
        (:meth:`_by_remaining`) to the requests whose next item the page rules let them write now
        (:meth:`_may_write`; one they stop would leave its share unused), each taking its ready items as the fcfs
        loop would (the last one may pass the budget). Adds to ``passed`` the requests with a writable item that the
        budget left nothing for."""
        left, shares, writable = self.config.encode_token_budget, {}, self._may_write()
        for req in order:
            if req.request_id not in writable:
                continue
            taken = 0
            for index in range(req.num_scheduled_items, len(req.encode_items)):
                if not req.item_ready(index):
                    break
                item = req.encode_items[index]
                if item.media_index in req.cached_media:  # a copy: free of the budget
                    continue
                if taken >= left:
                    if not taken:
                        passed.add(req.request_id)
                    break
                taken += item.num_patch_tokens
            if taken:
                shares[req.request_id] = taken
                left -= taken
        return shares

    def _may_write(self) -> set[str]:
        """Requests whose next item is ready and whose visual tokens the page rules of :meth:`_schedule_encode` let
        them write now (were nothing else written this step)."""
        writable, reserve, free = set(), -1, self.visual_pages.num_free_pages
        for req in self._page_priority():
            index = req.num_scheduled_items
            if index < len(req.encode_items) and req.item_ready(index):
                drop = req.skipped_visual_of(index)
                stream = self.visual_streams[req.request_id]
                after = free - stream.num_pages_to_write(req.encode_items[index].num_visual_tokens - drop)
                if after >= 0 and after >= reserve:
                    writable.add(req.request_id)
            reserve = max(reserve, self._pages_short(req))
        return writable

    def _prefill_shares(self, order: list[Request], passed: set[str]) -> dict[str, int]:
        """srpt: the prompt tokens each request may prefill this step, the budget given in ``order``
        (:meth:`_by_remaining`; after this step's encodes) to those that could prefill now: holding KV, or allowed
        to take it by the rules of :meth:`_schedule_prefill` (one that is not would leave its share unused). Adds
        to ``passed`` those the budget left nothing for."""
        stuck, blocked = set(), []  # in admission order, as the prefill loop takes KV
        for req in self.running:
            if req.has_kv or req.is_prefill_done or self._prefill_size(req, 1) <= 0:
                continue
            if not self._kv_fits(req, self._text_prefix(req)):
                blocked.append(req.request_id)
                stuck.add(req.request_id)
            elif self._passed_too_often(blocked):
                stuck.add(req.request_id)
        left, shares = self.config.prefill_token_budget, {}
        for req in order:
            if req.is_prefill_done or req.request_id in stuck or self._prefill_size(req, max(left, 1)) <= 0:
                continue
            size = self._prefill_size(req, left) if left > 0 else 0
            if size > left and shares:  # chunking off: a whole prompt past what is left waits for its own step
                size = 0
            if size > 0:
                shares[req.request_id] = size
                left -= size
            else:
                passed.add(req.request_id)
        return shares

    def _passed_too_often(self, request_ids) -> bool:
        """Whether one of ``request_ids`` has been passed ``max_kv_overtakes`` times: nobody may pass it now."""
        return any(self.kv_overtakes.get(r, 0) >= self.config.max_kv_overtakes for r in request_ids)

    def _pass(self, request_ids) -> None:
        """A later request took KV (or a seat) before each of ``request_ids``: one more overtake each."""
        for r in request_ids:
            self.kv_overtakes[r] = self.kv_overtakes.get(r, 0) + 1
