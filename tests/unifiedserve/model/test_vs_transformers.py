"""Our Qwen2.5-VL against transformers' ``Qwen2_5_VLForConditionalGeneration`` on the same checkpoint.

The demo checkpoint is written into a temporary directory and loaded twice: by
:func:`unifiedserve.model.load_model` and by transformers' ``from_pretrained`` (a local folder,
fp32, eager attention). Both get the same patches (from :mod:`flashcodec.patches`), grids and
prompt ids (from our processor). Our prefill runs through ``TorchPagedAttention`` on a paged
``KVCache`` in one chunk.

Largest absolute differences observed (fp32, torch 2.13 CPU, transformers 5.23; visual tokens and
logits are O(3-5)):

==============================  ===========  ===========
case                            vision       logits
==============================  ===========  ===========
text only (51 tokens)           -            3.1e-6
image 61x97 -> 56x84 (59)       4.5e-6       6.5e-6
video, 5 frames 84x140 (98)     4.3e-6       8.4e-6
image + video (106)             4.5e-6       7.6e-6
decode step after image+video   -            5.6e-6
image 140x252 + video 252x140   3.9e-6       -
==============================  ===========  ===========

(``pytest tests/unifiedserve/model/test_vs_transformers.py -s`` prints them.)
"""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from flashcodec.patches import frames_to_patches, image_to_patches
from unifiedserve.attention import AttentionMetadata, KVCache, TorchPagedAttention
from unifiedserve.model import decode_positions, get_rope_index, load_model, load_processor
from unifiedserve.model.demo import write_demo_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BLOCK_SIZE = 16
SECONDS_PER_GRID = 0.75  # x tokens_per_second 2 = interval 1.5: temporal positions 0, 1, 3 (truncated)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo-model"), seed=1)


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_model(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load_processor(checkpoint)


@pytest.fixture(scope="module")
def hf_model(checkpoint, use_released_rope):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            checkpoint, dtype=torch.float32, attn_implementation="eager")
    # positions by the released M-RoPE rule on both sides (transformers >= 5.3 differs after a video)
    return use_released_rope(model.eval())


def _image(processor, seed: int = 0) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A random 61x97 image resized to its model size (56x84) -> patches, grid."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (61, 97, 3), dtype=np.uint8)
    h, w = processor.image_size(61, 97)
    resized = np.asarray(Image.fromarray(pixels).resize((w, h), Image.BICUBIC))
    return image_to_patches(torch.from_numpy(resized.copy()).permute(2, 0, 1), processor.patch_spec)


def _video(processor, seed: int = 1) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """5 random 84x140 frames (padded to 6 by repeating the last) -> patches, grid (3, 6, 10)."""
    frames = torch.randint(0, 256, (5, 3, 84, 140), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return frames_to_patches(frames, processor.patch_spec)


def _prompt(processor, images, videos) -> list[int]:
    content = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
    content.append({"type": "text", "text": "What happens in this video? Please describe it."})
    text = processor.render_chat([{"role": "user", "content": content}])
    ids = processor.tokenize(text)
    return processor.expand_vision_tokens(ids, [g for _, g in images], [g for _, g in videos])


def _prefill(model, config, ids, visual_tokens, positions):
    """Full-sequence logits of one sequence prefilled in one chunk on a paged KV cache."""
    t = config.text
    num_blocks = -(-(len(ids) + 1) // BLOCK_SIZE)
    cache = KVCache(t.num_hidden_layers, num_blocks, BLOCK_SIZE, t.num_key_value_heads, t.head_dim)
    attn = TorchPagedAttention(cache, t.num_attention_heads, t.num_key_value_heads, t.head_dim)
    attn.begin(AttentionMetadata.build([(0, len(ids), list(range(num_blocks)))], BLOCK_SIZE))
    embeds = model.embed(torch.tensor(ids), visual_tokens)
    return model.compute_logits(model(embeds, positions, attn)), attn


def _hf_inputs(config, ids, images, videos) -> dict:
    input_ids = torch.tensor([ids])
    kw = {"input_ids": input_ids,
          "mm_token_type_ids": ((input_ids == config.image_token_id).int()
                                + 2 * (input_ids == config.video_token_id).int())}
    if images:
        kw["pixel_values"] = torch.cat([p for p, _ in images])
        kw["image_grid_thw"] = torch.tensor([g for _, g in images])
    if videos:
        kw["pixel_values_videos"] = torch.cat([p for p, _ in videos])
        kw["video_grid_thw"] = torch.tensor([g for _, g in videos])
        kw["second_per_grid_ts"] = torch.tensor([SECONDS_PER_GRID] * len(videos))
    return kw


CASES = {"text only": (0, 0), "image": (1, 0), "video": (0, 1), "image + video": (1, 1)}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, ours, hf_model, processor):
    model, config = ours
    images = [_image(processor)] * CASES[case][0]
    videos = [_video(processor)] * CASES[case][1]
    ids = _prompt(processor, images, videos)
    with torch.inference_mode():
        visual = None
        if images or videos:
            media = images + videos  # the prompt holds the images first, then the videos
            visual = torch.cat([model.encode_vision(p, [g]) for p, g in media])
            ref_visual = torch.cat([hf_model.model.visual(p, grid_thw=torch.tensor([g])).pooler_output
                                    for p, g in media])
            vision_diff = (visual - ref_visual).abs().max().item()
            assert vision_diff < ATOL
            print(f"\n{case}: vision tower max abs diff {vision_diff:.2e}")
        positions, _ = get_rope_index(ids, [g for _, g in images], [g for _, g in videos],
                                      [SECONDS_PER_GRID] * len(videos), config)
        logits, _ = _prefill(model, config, ids, visual, positions)
        ref = hf_model(**_hf_inputs(config, ids, images, videos)).logits[0]
    diff = (logits - ref).abs().max().item()
    print(f"{case}: {len(ids)} tokens, logits max abs diff {diff:.2e} (max |logit| {ref.abs().max():.1f})")
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=ATOL)


def test_decode_step_matches_transformers_cache(ours, hf_model, processor):
    """Prefill, then one decode token at ``L + delta``: same logits as transformers' cached step."""
    model, config = ours
    images, videos = [_image(processor)], [_video(processor)]
    ids = _prompt(processor, images, videos)
    next_id = processor.tokenize("The")[0]
    with torch.inference_mode():
        visual = torch.cat([model.encode_vision(p, [g]) for p, g in images + videos])
        positions, delta = get_rope_index(ids, [images[0][1]], [videos[0][1]], [SECONDS_PER_GRID], config)
        _, attn = _prefill(model, config, ids, visual, positions)
        num_blocks = attn.kv_cache.num_blocks
        attn.begin(AttentionMetadata.build([(len(ids), 1, list(range(num_blocks)))], BLOCK_SIZE))
        hidden = model(model.embed(torch.tensor([next_id])), decode_positions(len(ids), delta), attn)
        logits = model.compute_logits(hidden)[0]

        out = hf_model(**_hf_inputs(config, ids, images, videos), use_cache=True)
        # transformers 5.24 renamed the argument to `cache` (past_key_values is deprecated); earlier 5.x (the GPU
        # machine's 5.17) take past_key_values
        name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
        past = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        ref = hf_model(input_ids=torch.tensor([[next_id]]), **{name: past}, use_cache=True).logits[0, -1]
    print(f"\ndecode step: logits max abs diff {(logits - ref).abs().max().item():.2e}")
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=ATOL)


def test_vision_tower_matches_transformers_with_several_windows(ours, hf_model):
    """Larger grids (partial windows, several per frame), images and a video in one call."""
    model, _ = ours
    gen = torch.Generator().manual_seed(3)
    image, g1 = image_to_patches(torch.randint(0, 256, (3, 140, 252), dtype=torch.uint8, generator=gen))
    video, g2 = frames_to_patches(torch.randint(0, 256, (3, 3, 252, 140), dtype=torch.uint8, generator=gen))
    patches = torch.cat([image, video])
    with torch.inference_mode():
        tokens = model.encode_vision(patches, [g1, g2])
        ref = hf_model.model.visual(patches, grid_thw=torch.tensor([g1, g2])).pooler_output
    assert tokens.shape == (patches.shape[0] // 4, model.config.text.hidden_size)
    print(f"\nseveral windows: vision tower max abs diff {(tokens - ref).abs().max().item():.2e}")
    torch.testing.assert_close(tokens, ref, atol=ATOL, rtol=ATOL)


def test_config_matches_transformers(ours, hf_model):
    _, config = ours
    hf = hf_model.config
    assert config.text.vocab_size == hf.text_config.vocab_size
    assert config.text.mrope_section == tuple(hf.text_config.rope_parameters["mrope_section"])
    assert config.vision.fullatt_block_indexes == tuple(hf.vision_config.fullatt_block_indexes)
    assert config.image_token_id == hf.image_token_id and config.video_token_id == hf.video_token_id
    assert config.tie_word_embeddings == hf.tie_word_embeddings
