"""Load a Hugging Face Qwen2.5-VL checkpoint directory into :class:`Qwen2_5_VL`.

The module is built on the meta device (no memory, no random init), materialised empty on the
target device, and every parameter is filled from the ``*.safetensors`` shards through
``safe_open`` (memory-mapped; pickle is never used). Before any data is read, the checkpoint's
tensor names and shapes are checked against the model, and every problem is reported at once.

Checkpoint names. ``save_pretrained`` of transformers 5 and the published checkpoints use
``model.*`` (language model), ``visual.*`` and ``lm_head.weight``; transformers 5's in-memory
names ``model.language_model.*`` / ``model.visual.*`` are accepted too. Our parameters differ from
the checkpoint's in three visible ways:

* ``q_proj``/``k_proj``/``v_proj`` are concatenated into ``qkv_proj``, ``gate_proj``/``up_proj``
  into ``gate_up_proj`` (one matmul each);
* the Conv3d patch embedding ``[hidden, 3, 2, 14, 14]`` is stored as a Linear ``[hidden, 1176]``;
* the merger's ``ln_q``/``mlp.0``/``mlp.2`` are ``norm``/``fc1``/``fc2``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from flashcodec._errors import first_line
from unifiedserve.model.config import ModelConfig
from unifiedserve.model.qwen2_5_vl import Qwen2_5_VL
from unifiedserve.model.weight_pool import bind_parameters

__all__ = ["CheckpointError", "checkpoint_names", "checkpoint_shapes", "load_model", "weight_bytes", "zero_model"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LIST_LIMIT = 8  # names shown per kind of problem


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model (missing, unexpected or mis-shaped)."""


@dataclass(frozen=True)
class _Entry:
    file: Path
    key: str  # the name as stored in the file
    shape: tuple[int, ...]
    dtype: str = "F32"  # as safetensors names it


#: Stored dtypes the loader converts to the model's: floating point only (an integer or fp8 tensor is not weights
#: it can read as they are).
_STORED_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})


def checkpoint_names(param_name: str) -> list[str]:
    """Checkpoint tensor names (canonical ``model.*`` / ``visual.*`` form) that one of our
    parameters is built from, in concatenation order."""
    head, _, rest = param_name.partition(".")
    if head == "language_model":
        if rest == "tok_embeddings.weight":
            name = "model.embed_tokens.weight"
        elif rest == "lm_head.weight":
            name = "lm_head.weight"
        else:
            name = "model." + rest
    elif head == "visual":
        name = "visual." + (rest.replace("patch_embed.weight", "patch_embed.proj.weight")
                            .replace("merger.norm.", "merger.ln_q.")
                            .replace("merger.fc1.", "merger.mlp.0.")
                            .replace("merger.fc2.", "merger.mlp.2."))
    else:
        raise ValueError(f"unknown parameter {param_name!r}")
    if ".qkv_proj." in name:
        return [name.replace(".qkv_proj.", f".{p}_proj.") for p in "qkv"]
    if ".gate_up_proj." in name:
        return [name.replace(".gate_up_proj.", f".{p}_proj.") for p in ("gate", "up")]
    return [name]


def _canonical(key: str) -> str:
    """transformers 5 in-memory names -> the saved (canonical) names."""
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    if key.startswith("model.visual."):
        return key[len("model."):]
    return key


def checkpoint_shapes(param_name: str, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
    """Shapes of the checkpoint tensors behind one parameter (see :func:`checkpoint_names`)."""
    rest = shape[1:]
    if ".qkv_proj." in param_name:
        t = config.text
        q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
        return [(q, *rest), (kv, *rest), (kv, *rest)]
    if ".gate_up_proj." in param_name:
        return [(shape[0] // 2, *rest)] * 2
    if param_name == "visual.patch_embed.weight":
        v = config.vision
        return [(v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)]
    return [shape]


def _index_checkpoint(path: Path) -> dict[str, _Entry]:
    """Canonical tensor name -> where it is stored, for every tensor of every shard."""
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        try:
            index = json.loads(index_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            raise CheckpointError(f"{index_file} is not valid JSON: {e}") from None
        weight_map = index.get("weight_map", {}) if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index_file}: its weight_map must map tensor names to shard file names")
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index_file} lists shard(s) that do not exist: {missing}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}; the loader reads safetensors checkpoints only")
    entries: dict[str, _Entry] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = _canonical(key)
                    if name in entries:
                        raise CheckpointError(f"tensor {name!r} is stored twice ({entries[name].key!r} in "
                                              f"{entries[name].file.name}, {key!r} in {file.name})")
                    piece = f.get_slice(key)
                    entries[name] = _Entry(file, key, tuple(piece.get_shape()), str(piece.get_dtype()))
        except CheckpointError:
            raise
        except Exception as e:  # safetensors' SafetensorError, OSError (a directory, a truncated file), ...
            raise CheckpointError(f"{file}: not a readable safetensors file ({first_line(e)})") from None
    return entries


def _problems(kind: str, items: list[str]) -> str:
    more = len(items) - _LIST_LIMIT
    shown = ", ".join(items[:_LIST_LIMIT]) + (f" (and {more} more)" if more > 0 else "")
    return f"{len(items)} {kind}: {shown}"


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               llm_storage: torch.Tensor | None = None, fill_llm: bool = True,
               load_vision: bool = True) -> tuple[Qwen2_5_VL, ModelConfig]:
    """Build Qwen2.5-VL from a local checkpoint directory.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` or sharded
            ``model-*.safetensors`` + ``model.safetensors.index.json``.
        dtype: parameter dtype (float32, bfloat16 or float16); tensors are converted on load.
        device: where the parameters live.
        llm_storage: a shared uint8 byte pool (``weight_pool.llm_weight_bytes``) on ``device`` that
            holds the language model's parameters: they become views of it instead of new memory.
        fill_llm: with ``llm_storage``, whether to read the language model's tensors from the
            checkpoint (the process that loads them) or trust the pool's contents (every other).
        load_vision: False leaves the vision tower unallocated (on the ``meta`` device) and unread,
            for a process that never encodes (the decode process): on Qwen2.5-VL-7B that is 0.68 B
            parameters, 1.35 GB in bf16, it would otherwise hold for nothing.
    Returns:
        ``(model, config)``, the model in eval mode without gradients.
    Raises:
        ValueError: bad arguments or ``config.json``.
        CheckpointError: missing, unexpected or mis-shaped tensors (all of them named).
    """
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
    if llm_storage is not None and llm_storage.device != torch.empty(0, device=device).device:
        raise ValueError(f"llm_storage is on {llm_storage.device}, the model on {device}")
    path = Path(path).expanduser()
    config, model, plan = _plan(path)
    model.to(dtype)

    if llm_storage is None:
        model.language_model.to_empty(device=device)
    else:  # the LLM lives in the shared pool: allocate only the vision tower here
        bind_parameters(model.language_model, llm_storage)
        if not fill_llm:
            plan = [(name, found) for name, found in plan if not name.startswith("language_model.")]
    if load_vision:
        model.visual.to_empty(device=device)
    else:
        plan = [(name, found) for name, found in plan if not name.startswith("visual.")]
    params = dict(model.named_parameters())
    files = {f: safe_open(f, framework="pt", device="cpu") for f in {e.file for _, found in plan for e in found}}
    with torch.no_grad():
        for name, found in plan:
            param, row = params[name], 0
            for e in found:  # fused parameters: each part fills its own rows
                value = files[e.file].get_tensor(e.key)  # memory-mapped read
                rows = value.shape[0]
                param[row:row + rows].copy_(value.reshape(rows, *param.shape[1:]))  # casts dtype, moves device
                row += rows
    _align_vision(model, device, load_vision)
    model.eval().requires_grad_(False)
    return model, config


def check_checkpoint(path: str | Path) -> ModelConfig:
    """What :func:`load_model` checks before it reads a weight, without reading one: ``config.json``, every shard's
    header, and each tensor's name, shape and type against the model (on the ``meta`` device). The server runs it
    before it starts a worker, so a bad checkpoint is one error line, not a traceback from each worker.

    Raises:
        ValueError: a missing folder or a bad ``config.json``.
        CheckpointError: an unreadable shard or index, or missing, unexpected, mis-shaped or non-float tensors.
    """
    return _plan(Path(path).expanduser())[0]


def _plan(path: Path) -> tuple[ModelConfig, Qwen2_5_VL, list[tuple[str, list[_Entry]]]]:
    """``(config, model on the meta device, [(parameter, its checkpoint entries)])`` of a checkpoint folder.

    Raises: as :func:`check_checkpoint`.
    """
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {path} does not exist")
    config = ModelConfig.from_json(path)
    entries = _index_checkpoint(path)
    with torch.device("meta"):
        model = Qwen2_5_VL(config)
    plan: list[tuple[str, list[_Entry]]] = []
    missing, misshaped, mistyped, used = [], [], [], set()
    for name, param in model.named_parameters():
        sources = checkpoint_names(name)
        shapes = checkpoint_shapes(name, tuple(param.shape), config)
        found = []
        for src, shape in zip(sources, shapes):
            used.add(src)
            entry = entries.get(src)
            if entry is None:
                missing.append(src)
            elif entry.shape != shape:
                misshaped.append(f"{src} has shape {list(entry.shape)}, expected {list(shape)}")
            elif entry.dtype not in _STORED_FLOATS:
                mistyped.append(f"{src} is {entry.dtype}")
            else:
                found.append(entry)
        plan.append((name, found))
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()  # a tied head may still be saved
    unexpected = sorted(set(entries) - used - ignored)
    errors = [_problems(kind, items) for kind, items in (
        ("missing tensors", missing), ("unexpected tensors", unexpected), ("mis-shaped tensors", misshaped),
        ("tensors that are not floating point", mistyped)) if items]
    if errors:
        raise CheckpointError(f"checkpoint {path} does not match the Qwen2.5-VL model of its config.json: "
                              + "; ".join(errors))
    return config, model, plan


def _align_vision(model: Qwen2_5_VL, device: str | torch.device, loaded: bool) -> None:
    """On CUDA, the vision MLPs padded to aligned widths (same outputs; see ``VisionTower.align_mlp``).
    ``UNIFIEDSERVE_VISION_MLP_ALIGN=0`` keeps the checkpoint's widths (to measure one against the other)."""
    if loaded and torch.device(device).type == "cuda" and os.environ.get("UNIFIEDSERVE_VISION_MLP_ALIGN", "1") != "0":
        model.visual.align_mlp()


def zero_model(path: str | Path, dtype: torch.dtype, device: str | torch.device) -> tuple[Qwen2_5_VL, ModelConfig]:
    """The model of ``path``'s ``config.json`` with every parameter zero, on ``device``: the checkpoint is not
    read. For measuring memory (the server's start-up profile), where only shapes and dtypes matter.

    Raises:
        ValueError: a dtype outside the supported ones, or a folder without a valid ``config.json``.
    """
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
    config = ModelConfig.from_json(Path(path).expanduser())
    with torch.device("meta"):
        model = Qwen2_5_VL(config)
    model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    _align_vision(model, device, True)
    model.eval().requires_grad_(False)
    return model, config


def weight_bytes(model: torch.nn.Module, shared: torch.Tensor | None = None) -> tuple[int, int]:
    """``(bytes this process allocated for ``model``'s parameters, bytes of them that are views of
    ``shared``)`` (the shared LLM weights pool); parameters left on ``meta`` count in neither."""
    own = in_shared = 0
    pool = shared.untyped_storage().data_ptr() if shared is not None else None
    for param in model.parameters():
        if param.is_meta:
            continue
        n = param.numel() * param.element_size()
        if pool is not None and param.untyped_storage().data_ptr() == pool:
            in_shared += n
        else:
            own += n
    return own, in_shared
