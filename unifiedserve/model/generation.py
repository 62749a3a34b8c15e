"""A checkpoint's ``generation_config.json``: its end-of-sequence tokens and its default sampling parameters.

transformers' ``generate`` stops on every id of the generation config's ``eos_token_id`` (Qwen2.5-VL's
instruct checkpoints list ``<|im_end|>`` and ``<|endoftext|>``, while their ``config.json`` names only the
first), and samples with its ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` unless told
otherwise. vLLM's server does the same by default (``--generation-config auto``): those fields, and
``max_new_tokens``, are the defaults of a request that does not set them. So does this server
(``unifiedserve serve --generation-config auto|none|DIR``). As in vLLM, ``do_sample`` is not read: a request
is greedy when its temperature (its own or the default) is 0 (below 1e-5).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from unifiedserve.engine.params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

__all__ = ["GenerationDefaults", "read_generation_config", "generation_eos_ids"]

FILE = "generation_config.json"
#: Sampling fields of a generation config that this server does not implement: said once at start-up when
#: they ask for something (their neutral value asks for nothing).
_UNSUPPORTED = {"typical_p": (None, 1, 1.0), "epsilon_cutoff": (None, 0, 0.0),
                "eta_cutoff": (None, 0, 0.0), "no_repeat_ngram_size": (None, 0), "num_beams": (None, 1),
                "encoder_repetition_penalty": (None, 1, 1.0), "min_new_tokens": (None, 0)}


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    """The JSON of ``folder/generation_config.json``; ``{}`` when there is none.

    Raises:
        ValueError: the file is not a JSON object.
    """
    file = Path(folder).expanduser() / FILE
    if not file.is_file():
        return {}
    try:
        cfg = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return cfg


def generation_eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    """The generation config's ``eos_token_id`` (an id or a list of ids) as a tuple; () when absent.

    Raises:
        ValueError: it is neither an integer nor a list of integers.
    """
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{FILE}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    return tuple(ids)


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults for what a request leaves out (None: the OpenAI API's default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    max_tokens: int | None = None  # the generation config's max_new_tokens
    #: the generation config's sampling fields this server does not implement, with their values
    unsupported: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_config(cls, cfg: dict[str, Any], source: str = FILE) -> GenerationDefaults:
        """The defaults a generation config sets.

        Raises:
            ValueError: a value is of the wrong type or out of its range (named with ``source``).
        """
        def number(key: str, ok, what: str, integer: bool = False):
            value = cfg.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) \
                    or not math.isfinite(value) or not ok(value):
                raise ValueError(f"{source}: {key} must be {what}, got {value!r}")
            return value if integer else float(value)

        unsupported = tuple((k, cfg[k]) for k, neutral in _UNSUPPORTED.items()
                            if k in cfg and not any(cfg[k] == n and type(cfg[k]) is type(n) for n in neutral))
        return cls(temperature=number("temperature", lambda v: v >= 0, "a number >= 0"),
                   top_p=number("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
                   top_k=number("top_k", lambda v: v >= 0, "an integer >= 0", integer=True),
                   repetition_penalty=number("repetition_penalty",
                                             lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
                                             f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"),
                   min_p=number("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
                   max_tokens=number("max_new_tokens", lambda v: v >= 1, "an integer >= 1", integer=True),
                   unsupported=unsupported)

    @classmethod
    def load(cls, folder: str | Path) -> GenerationDefaults:
        """:meth:`from_config` of ``folder``'s generation config (none: no defaults)."""
        return cls.from_config(read_generation_config(folder), str(Path(folder).expanduser() / FILE))

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self) if f.name != "unsupported")

    def describe(self) -> str:
        """``temperature=0.1, top_p=0.001, ...``: the defaults it sets."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                         if f.name != "unsupported" and getattr(self, f.name) is not None)
