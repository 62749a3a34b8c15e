"""The scheduler's configuration and what one step asks of the runner (:mod:`unifiedserve.engine.scheduler`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from unifiedserve.memory.pages import RaggedIndex


#: A GPU server's budgets when neither is given nor derived from a TBT SLO: the paper's testbed values for
#: Qwen2.5-VL (FlashCodec + UnifiedServe, section 7, "Testbed": prefill 2048, encode 10240), instead of the
#: CPU demo model's defaults below, whose 512-token chunks would each re-read a 7B model's weights for little work.
GPU_TOKEN_BUDGETS = {"prefill_token_budget": 2048, "encode_token_budget": 10240}


def server_token_budgets(device: str, explicit: dict[str, int], tbt_slo_ms: float | None) -> dict[str, int]:
    """The budgets a server passes on: the ``explicit`` flags, filled on a GPU with :data:`GPU_TOKEN_BUDGETS`
    unless a TBT SLO derives the others (then only the explicit ones, which win over the derived)."""
    if device == "cpu" or tbt_slo_ms is not None:
        return dict(explicit)
    return {**GPU_TOKEN_BUDGETS, **explicit}


#: ``srpt``: the encode and prefill budgets go first to the request with the fewest prompt tokens left to prefill,
#: counted in whole prefill budgets (shortest remaining processing time: a short question is not held behind a long
#: video's encode and prefill, and among requests within one budget the oldest goes first); ``fcfs``: to the oldest
#: request first
SCHEDULING_POLICIES = ("srpt", "fcfs")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets. Defaults suit the CPU demo model (a GPU server: :data:`GPU_TOKEN_BUDGETS`)."""

    prefill_token_budget: int = 512  # tau: prompt tokens prefilled per step, at most
    encode_token_budget: int = 4096  # alpha: patch tokens encoded per step (a unit may exceed it)
    max_num_seqs: int = 64  # requests admitted at once
    enable_chunked_prefill: bool = True  # False: a prompt is prefilled in one step, whatever its size
    #: True: the runner writes an admitted request's patches in the admission step (one process).
    #: False: another process writes them and reports each media with ``mark_media_ready``.
    patches_ready_on_admit: bool = True
    #: How many later requests may take KV blocks before a request that is waiting for them.
    max_kv_overtakes: int = 64
    #: requests decoded together at most; later ones wait, in order, until one of these finishes
    max_decode_batch: int = 256
    #: who gets the encode and prefill budgets first (:data:`SCHEDULING_POLICIES`)
    scheduling_policy: str = "srpt"
    #: srpt: a request that could have used a budget and was given none of it (the srpt order gave it to others)
    #: this many times since it last ran goes first
    max_passed_steps: int = 64

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.max_kv_overtakes < 0 or self.max_passed_steps < 0:
            raise ValueError(f"max_kv_overtakes and max_passed_steps must be >= 0, got {self.max_kv_overtakes} and "
                             f"{self.max_passed_steps}")
        for name in ("prefill_token_budget", "encode_token_budget", "max_num_seqs", "max_decode_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class PrefillChunk:
    request_id: str
    start: int  # first prompt position in this chunk
    num_tokens: int
    is_last: bool  # the chunk completes the prompt: sample the first output token


@dataclass(frozen=True)
class EncodeWork:
    request_id: str
    item_index: int
    from_cache: bool = False  # copy the item's visual tokens from the media cache instead of encoding
    skip_visual: int = 0  # a copy's first tokens that the cached prefix already holds: not written


class MediaCacheIndex:
    """What the scheduler needs of a media cache: membership and pins (an entry in use is never evicted)."""

    def pin(self, key: str) -> bool:  # pragma: no cover - interface
        """Hold ``key``'s entry if present; returns whether it is."""
        raise NotImplementedError

    def unpin(self, key: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass
class SchedulerOutput:
    """What to run in one step. Built in full by the scheduler; the runner only executes it.

    The runner executes in this order: patch writes, vision encode (patch reads, visual-token
    writes), then one LLM forward over the prefill chunks and decode tokens (visual-token reads).
    Pages this step's reads consume completely are listed in ``freed_*_pages``; they go back to
    their allocators in :meth:`Scheduler.commit`, after the step has run.
    """

    admitted: list[str] = field(default_factory=list)  # write all their vision patches this step
    #: admitted requests' media that have no patches (cached prefix or media cache): not written
    skip_media: dict[str, list[int]] = field(default_factory=dict)
    #: KV block tables of requests whose prefill starts this step (prompt + max_tokens: never change)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    patch_write: RaggedIndex | None = None  # rows: admitted requests' patches, in admitted order
    encode: list[EncodeWork] = field(default_factory=list)
    patch_read: RaggedIndex | None = None  # rows: the encode items' patches, in encode order
    visual_write: RaggedIndex | None = None  # rows: the encode items' visual tokens, in encode order
    prefill: list[PrefillChunk] = field(default_factory=list)
    visual_read: RaggedIndex | None = None  # rows: visual tokens of the prefill chunks, in chunk order
    decode: list[str] = field(default_factory=list)  # one new token each
    freed_patch_pages: list[int] = field(default_factory=list)  # consumed by patch_read; freed at commit
    freed_visual_pages: list[int] = field(default_factory=list)  # consumed by visual_read; freed at commit
    #: media-cache entries whose last item is copied this step: unpinned at commit
    unpin_media_keys: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.admitted or self.encode or self.prefill or self.decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefill)
