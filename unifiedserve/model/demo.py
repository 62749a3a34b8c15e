"""A tiny random-weight Qwen2.5-VL checkpoint in Hugging Face format, for tests and demos.

:func:`write_demo_model` writes, deterministically from a seed, everything a real checkpoint has:
``config.json`` (transformers 5 layout), ``model.safetensors`` (or shards + index),
``tokenizer.json`` (a byte-level BPE trained here on a small built-in English corpus, plus Qwen's
special tokens), ``tokenizer_config.json`` (a Qwen2-VL style chat template),
``preprocessor_config.json`` and ``generation_config.json``. transformers loads it with
``Qwen2_5_VLForConditionalGeneration.from_pretrained(path)``.

Sizes keep Qwen2.5-VL-7B's shapes where they matter for serving (patch 14, merge 2, window 112 px,
full-attention blocks at the end of each group of blocks, vision head_dim 80, GQA, M-RoPE
sections in 7B's 1:1.5:1.5 proportion) and shrink the widths so that CPU runs are quick.

Encode/decode cost, measured with ``unifiedserve demo-model --measure`` (fp32, torch 2.13, 2 CPU
cores shared with other jobs, median of 9 after warmup, four runs): encoding one temporal slice of a
392x728 frame pair (1456 patch tokens -> 364 visual tokens) took 114-135 ms and one batch-1 decode
step over a 400-token context 4.9-7.8 ms: a ratio of about 16-28 (28 on one thread: 198 / 7.2 ms).
The decode step is bound by reading the weights, as on a GPU; by FLOPs the demo's ratio is 925.

For reference, Qwen2.5-VL-7B by FLOPs (:func:`encode_decode_flop_ratio`): the slice costs 1.93 TFLOP
and a decode step 14.3 GFLOP (28 layers + lm_head, 400-token context), a ratio of about 135. On a
GPU the time ratio is far lower than that, since the decode step is bound by memory bandwidth
(about 15 GB of bf16 weights per step) while the encode is bound by compute.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashcodec._errors import first_line
from unifiedserve.model.config import ModelConfig, TextConfig, VisionConfig
from unifiedserve.model.loader import checkpoint_names, checkpoint_shapes
from unifiedserve.model.presets import DEFAULT_DEMO_PATH, PRESETS, preset_architecture
from unifiedserve.model.qwen2_5_vl import Qwen2_5_VL

__all__ = ["DEFAULT_DEMO_PATH", "DEMO_VISION", "SPECIAL_TOKENS", "demo_config", "encode_decode_flop_ratio",
           "measure_encode_decode_ratio", "write_demo_model"]

MAX_SHARD_BYTES = 4 * 2**30  # default shard size of the public presets

#: Qwen's special tokens, appended after the BPE vocabulary in this order.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")

DEMO_VISION = VisionConfig(depth=8, hidden_size=160, num_heads=2, intermediate_size=432, out_hidden_size=256,
                           window_size=112, fullatt_block_indexes=(3, 7), tokens_per_second=2)
_DEMO_TEXT = dict(hidden_size=256, intermediate_size=1344, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, mrope_section=(8, 12, 12), rope_theta=1000000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=32768)
_BPE_VOCAB_SIZE = 1400


def demo_text_config(vocab_size: int = 64) -> TextConfig:
    """The demo model's language-model config (its vocabulary is the tokenizer's, padded to 64)."""
    return TextConfig(vocab_size=vocab_size, **_DEMO_TEXT)


def preset_shapes(name: str) -> tuple[TextConfig, VisionConfig]:
    """The text and vision configs of a preset, ``tiny`` (the demo model) or a public one, with no checkpoint.

    Raises:
        ValueError: an unknown name.
    """
    if name == "tiny":
        return demo_text_config(), DEMO_VISION
    text, vision, _ = preset_architecture(name)
    return text, vision

# Qwen2-VL style: a default system turn, one <|vision_start|><|image_pad|><|vision_end|> per image.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden fence.
A video is a sequence of frames, and every frame is a picture taken a small fraction of a second \
after the one before it.
The model looks at the picture, describes what it sees, and answers questions about the people, \
animals and objects in it.
In the morning the market fills with people buying bread, fruit, fish, cheese and fresh flowers for the weekend.
She opened the window, and the cold air of the mountains came into the small kitchen with the smell of pine trees.
Children were playing football in the park near the river until the sun went down behind the tall buildings.
The train left the station at seven o'clock and arrived in the city two hours later, just before the meeting started.
He wrote a long letter to his grandmother, telling her about his new school, his friends and the books he was reading.
A red car stopped at the corner, a man stepped out with a black umbrella, and it began to rain heavily.
What is the color of the sky? The sky is blue during the day and dark at night, with stars and a bright moon.
How many people are in the room? There are three people sitting at the table and one person standing by the door.
Please describe this image in detail. The image shows a cat sleeping on a sofa next to a large window.
Please summarize the video. The video shows a cooking lesson: first the teacher cuts the vegetables, \
then she boils water.
The weather today is sunny with a light wind from the west, and tomorrow it will be cloudy \
with some rain in the evening.
Engineers measure the time it takes to decode a frame, to encode the patches, and to generate each new token.
Serving many users at once means sharing the memory of the machine between their requests in small blocks.
The scheduler decides which requests run in the next step, and the model runner executes them on the device.
Long videos contain thousands of frames, so the system samples two frames per second and resizes them to fit a budget.
Our garden has apple trees, a small pond with green frogs, and a path of white stones leading to the back gate.
The library is open from nine in the morning until six in the evening, except on Sundays and public holidays.
They travelled across the country by bus, visiting museums, castles, beaches and quiet villages along the coast.
The doctor asked the patient how he was feeling, listened to his heart, and told him to rest for a few days.
Music filled the hall as the orchestra began to play, and the audience listened in complete silence.
A good answer is short, clear and correct; it explains the reason and gives an example when that helps.
The number of visual tokens depends on the height and the width of the image and on the length of the video.
Every student should read the question carefully, think about the answer, and then write it down in their own words.
The bird built its nest on the highest branch of the tree, far away from the cats and the curious children.
In winter the lake freezes, and families come with their skates, hot chocolate and warm woollen hats.
The computer program reads the input, checks that it is valid, and reports a clear error when something is wrong.
Yesterday we watched a film about the ocean, with whales, dolphins, sharks and thousands of bright little fish.
The kitchen table was covered with flour, eggs, sugar and butter, because they were baking a birthday cake.
Tell me a story about a dragon who wanted to learn how to read. Once upon a time there lived a lonely dragon.
The answer is yes. The answer is no. I do not know the answer, but I can try to find it for you.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, thirty, hundred, thousand.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the seven days of the week.
January, February, March, April, May, June, July, August, September, October, November and December.
"""


def demo_config(num_tokens: int, token_ids: dict[str, int], tie_word_embeddings: bool | None = None,
                preset: str = "tiny", **overrides) -> ModelConfig:
    """The configuration of a random-weight checkpoint for a tokenizer with ``num_tokens`` tokens.

    ``tiny`` is the demo model (vocabulary padded to 64); the public presets take their architecture
    from :mod:`unifiedserve.model.presets` (``overrides``: ``num_text_layers``, ``num_vision_layers``,
    ``vocab_size``). ``tie_word_embeddings`` None keeps the preset's own choice.
    """
    if preset == "tiny":
        if overrides:
            raise ValueError(f"the tiny preset takes no {', '.join(sorted(overrides))}")
        text, vision, tie = demo_text_config(-(-num_tokens // 64) * 64), DEMO_VISION, False
    else:
        text, vision, tie = preset_architecture(preset, **overrides)
        if text.vocab_size < num_tokens:
            raise ValueError(f"vocab_size {text.vocab_size} is smaller than the tokenizer's {num_tokens} tokens")
    return ModelConfig(
        text=text,
        vision=vision,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        bos_token_id=token_ids["<|endoftext|>"],
        eos_token_ids=(token_ids["<|im_end|>"],),
        tie_word_embeddings=tie if tie_word_embeddings is None else tie_word_embeddings,
    )


def _train_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_BPE_VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def _weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names (Hugging Face) and shapes of ``config``, without allocating anything."""
    with torch.device("meta"):
        model = Qwen2_5_VL(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        shapes.update(zip(checkpoint_names(name), checkpoint_shapes(name, tuple(param.shape), config)))
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One checkpoint tensor (float32, on the generator's device) with a scale that keeps activations O(1)."""
    x = torch.randn(shape, generator=gen, device=gen.device)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight") or ".norm" in name or "ln_q" in name:
        return 1.0 + 0.1 * x  # RMSNorm scales
    if name.endswith(".bias"):
        return 0.1 * x
    return x * math.prod(shape[1:]) ** -0.5  # weights (and embeddings) ~ 1 / sqrt(fan_in)


def _split_shards(sizes: dict[str, int], num_shards: int) -> list[list[str]]:
    """Consecutive runs of the sorted names, each about ``1 / num_shards`` of the bytes."""
    names, total = sorted(sizes), sum(sizes.values())
    shards, current, size = [], [], 0
    for i, name in enumerate(names):
        current.append(name)
        size += sizes[name]
        if i == len(names) - 1 or (size >= total * (len(shards) + 1) / num_shards and len(shards) < num_shards - 1):
            shards.append(current)
            current = []
    if len(shards) != num_shards:
        raise ValueError(f"could not split the weights into {num_shards} shards; use fewer")
    return shards


def _write_weights(config: ModelConfig, path: Path, seed: int, num_shards: int | None, dtype: torch.dtype,
                   device: str, progress: Callable[[int, int], None] | None = None) -> None:
    """Generate and save the weights one shard at a time (a 7B checkpoint never sits in memory whole).

    Tensors are drawn in sorted-name order from one generator, so a seed gives the same weights
    whatever the sharding (on one device kind: CPU and CUDA generators differ). ``progress(done, total)``
    (bytes of the stored weights) follows each tensor drawn and each shard saved, whose bytes count half each.
    """
    shapes = _weight_shapes(config)
    sizes = {name: math.prod(shape) * dtype.itemsize for name, shape in shapes.items()}
    if num_shards is None:
        num_shards = max(1, -(-sum(sizes.values()) // MAX_SHARD_BYTES))
    shards = _split_shards(sizes, num_shards)
    gen = torch.Generator(device).manual_seed(seed)
    weight_map = {}
    total, done = sum(sizes.values()), 0
    for index, names in enumerate(shards):
        file = "model.safetensors" if num_shards == 1 else f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
        tensors = {}
        for name in names:
            tensors[name] = _random_tensor(name, shapes[name], gen).to(dtype).cpu().contiguous()
            done += sizes[name] // 2
            if progress is not None:
                progress(done, total)
        try:
            save_file(tensors, path / file, metadata={"format": "pt"})
        except Exception as e:  # safetensors' own error type for a full disk, a quota, a read-only folder
            raise OSError(f"{path / file}: cannot be written ({first_line(e)})") from None
        done += sum(sizes[name] - sizes[name] // 2 for name in names)
        if progress is not None:
            progress(done, total)
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    if num_shards > 1:
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=2))


def _check_room(path: Path, config, dtype: torch.dtype) -> None:
    """Raise OSError when ``path`` cannot be written or its disk lacks room for the weights (a 7B preset is
    30 GB in float32), before a previous checkpoint there is deleted."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OSError(f"{path}: cannot write there (no permission on {existing})")
    need = sum(math.prod(shape) for shape in _weight_shapes(config).values()) * dtype.itemsize
    freed = sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0
    free = shutil.disk_usage(existing).free + freed
    if need > free:
        raise OSError(f"{path}: the weights need {need / 2**30:.1f} GiB, the disk has {free / 2**30:.1f} GiB free")


def write_demo_model(path: str | Path = DEFAULT_DEMO_PATH, *, seed: int = 0, num_shards: int | None = None,
                     tie_word_embeddings: bool | None = None, dtype: torch.dtype = torch.float32,
                     preset: str = "tiny", num_text_layers: int | None = None, num_vision_layers: int | None = None,
                     vocab_size: int | None = None, device: str | None = None,
                     progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a random-weight checkpoint into ``path`` (created if needed; existing files are replaced).

    Args:
        seed: seeds the random weights; the tokenizer does not depend on it.
        num_shards: 1 writes ``model.safetensors``; more write ``model-0000i-of-0000n.safetensors``
            and ``model.safetensors.index.json``. None: 1 for the tiny model, else one per 4 GiB.
        tie_word_embeddings: share the token embedding with the output projection (no lm_head);
            None keeps the preset's choice (tiny: untied, 3B: tied, 7B: untied).
        dtype: dtype of the stored weights.
        preset: ``tiny`` (the demo model) or a public architecture (:data:`presets.PRESETS`).
        num_text_layers, num_vision_layers, vocab_size: shrink a public preset (tests at real widths).
        device: where the random numbers are drawn (default: CUDA for public presets when present,
            which takes seconds instead of minutes for a 7B; the CPU for ``tiny``, whose weights tests pin).
        progress: called as ``progress(done, total)`` in bytes of the weights while they are drawn and saved.
    Returns:
        The checkpoint directory.
    Raises:
        ValueError: a bad preset, shard count or override; ``path`` a file, or a folder holding files that a demo
            checkpoint does not have (its weights would be deleted).
    """
    if num_shards is not None and (not isinstance(num_shards, int) or not 1 <= num_shards <= 64):
        raise ValueError(f"num_shards must be an integer in 1..64, got {num_shards!r}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    overrides = {k: v for k, v in (("num_text_layers", num_text_layers), ("num_vision_layers", num_vision_layers),
                                   ("vocab_size", vocab_size)) if v is not None}
    if device is None:
        device = "cuda" if preset != "tiny" and torch.cuda.is_available() else "cpu"
    path = Path(path).expanduser()
    _check_folder(path)
    tokenizer = _train_tokenizer()
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    config = demo_config(tokenizer.get_vocab_size(), ids, tie_word_embeddings, preset, **overrides)
    _check_room(path, config, dtype)  # before anything of a previous checkpoint is deleted
    path.mkdir(parents=True, exist_ok=True)
    # config.json goes first and comes back last: callers take its presence to mean a whole checkpoint (LLM() and
    # `serve` with no --model write the demo model only when it is missing), so a process that starts while this
    # one writes waits for it or writes its own, and never loads half a checkpoint
    (path / "config.json").unlink(missing_ok=True)
    for old in list(path.glob("*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    try:
        tokenizer.save(str(path / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a plain Exception (e.g. "Permission denied (os error 13)")
        raise OSError(f"{path / 'tokenizer.json'}: cannot be written ({first_line(e)})") from None
    hf = config.to_hf_dict()
    hf["dtype"] = str(dtype).removeprefix("torch.")
    _write_weights(config, path, seed, num_shards, dtype, device, progress)  # no lm_head when tied

    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": config.text.max_position_embeddings,
        "add_prefix_space": False,
        "errors": "replace",
        "split_special_tokens": False,
    })
    _write_json(path / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": 3136, "max_pixels": 12845056,
        "patch_size": config.vision.patch_size, "temporal_patch_size": config.vision.temporal_patch_size,
        "merge_size": config.vision.spatial_merge_size,
    })
    _write_json(path / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": False,
    })
    _write_json(path / "config.json", hf)  # last (see above), and whole: written aside, then renamed into place
    return path


_OWN_FILES = re.compile(r"(config|generation_config|preprocessor_config|tokenizer|tokenizer_config)\.json"
                        r"|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|\..+\.\d+\.part")


def _check_folder(path: Path) -> None:
    """Refuse a folder that holds anything a demo checkpoint does not: its old weights would be deleted and its
    other files mixed with a checkpoint's (``demo-model .`` in a project, or a real checkpoint's folder)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file; give a folder for the checkpoint")
    if not path.is_dir():
        return
    foreign = sorted(entry.name for entry in path.iterdir() if not _OWN_FILES.fullmatch(entry.name))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(f"{path} holds files a demo checkpoint does not ({shown}); give a new or empty folder, or "
                         "one that demo-model wrote (its weights are replaced)")


def _write_json(file: Path, obj: dict) -> None:
    part = file.with_name(f".{file.name}.{os.getpid()}.part")
    part.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(part, file)


# --- cost of encoding a frame pair vs one decode step -----------------------------------------


def vision_slice_flops(vision: VisionConfig, height: int = 392, width: int = 728) -> int:
    """Matmul FLOPs (2 per multiply-add) to encode one ``height x width`` frame pair (one temporal slice)."""
    from unifiedserve.model.vision import vision_layout

    gh, gw = height // vision.patch_size, width // vision.patch_size
    n, d = gh * gw, vision.hidden_size
    layout = vision_layout(((1, gh, gw),), vision.spatial_merge_size, vision.window_merge_units)
    flops = 2 * n * vision.patch_dim * d  # patch embedding
    for i in range(vision.depth):
        lens = layout.frame_lens if i in vision.fullatt_block_indexes else layout.window_lens
        flops += 2 * n * d * (3 * d + d + 3 * vision.intermediate_size)  # qkv, proj, gate/up/down
        flops += sum(4 * length * length * d for length in lens)  # QK^T and PV inside each segment
    merged = d * vision.merge_unit
    return flops + 2 * (n // vision.merge_unit) * merged * (merged + vision.out_hidden_size)


def decode_step_flops(text: TextConfig, context_len: int = 400) -> int:
    """Matmul FLOPs of one batch-1 decode step attending over ``context_len`` tokens."""
    d, q, kv = text.hidden_size, text.num_attention_heads * text.head_dim, text.num_key_value_heads * text.head_dim
    per_layer = 2 * d * (q + 2 * kv) + 2 * q * d + 2 * 3 * d * text.intermediate_size + 4 * context_len * q
    return text.num_hidden_layers * per_layer + 2 * d * text.vocab_size


def encode_decode_flop_ratio(config: ModelConfig | None = None, height: int = 392, width: int = 728,
                             context_len: int = 400) -> float:
    """FLOPs of one frame-pair encode over one decode step; Qwen2.5-VL-7B when ``config`` is None."""
    config = config or ModelConfig()
    return vision_slice_flops(config.vision, height, width) / decode_step_flops(config.text, context_len)


def measure_encode_decode_ratio(path: str | Path = DEFAULT_DEMO_PATH, height: int = 392, width: int = 728,
                                context_len: int = 400, repeats: int = 9) -> dict[str, float]:
    """Time (median of ``repeats``, after one warmup) the encode of one ``height x width`` frame pair
    and one batch-1 decode step over ``context_len`` cached tokens, fp32, on the CPU."""
    from unifiedserve.attention import AttentionMetadata, KVCache, TorchPagedAttention
    from unifiedserve.model.loader import load_model

    model, config = load_model(path)
    v, t = config.vision, config.text
    gh, gw = height // v.patch_size, width // v.patch_size
    patches = torch.randn(gh * gw, v.patch_dim, generator=torch.Generator().manual_seed(0))
    block_size = 16
    num_blocks = -(-context_len // block_size)
    cache = KVCache(t.num_hidden_layers, num_blocks, block_size, t.num_key_value_heads, t.head_dim)
    attn = TorchPagedAttention(cache, t.num_attention_heads, t.num_key_value_heads, t.head_dim)
    meta = AttentionMetadata.build([(context_len - 1, 1, list(range(num_blocks)))], block_size)
    token = torch.tensor([1])
    positions = torch.full((3, 1), context_len - 1, dtype=torch.int64)

    def encode() -> None:
        model.encode_vision(patches, [(1, gh, gw)])

    def decode() -> None:
        attn.begin(meta)
        hidden = model(model.embed(token), positions, attn)
        model.compute_logits(hidden)

    def median_s(fn) -> float:
        fn()  # warmup
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    with torch.inference_mode():
        encode_s, decode_s = median_s(encode), median_s(decode)
    return {"encode_ms": encode_s * 1e3, "decode_step_ms": decode_s * 1e3, "ratio": encode_s / decode_s,
            "demo_flop_ratio": encode_decode_flop_ratio(config, height, width, context_len),
            "qwen2_5_vl_7b_flop_ratio": encode_decode_flop_ratio(None, height, width, context_len),
            "torch_threads": torch.get_num_threads()}
