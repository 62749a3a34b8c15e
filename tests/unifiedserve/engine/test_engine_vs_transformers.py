"""The engine's greedy tokens equal transformers' Qwen2_5_VLForConditionalGeneration (fp32), logits close.

Every case also compares the logits of every generated token; the largest difference seen when
this was written was below 1e-5 (fp32; attention and matmul order differ slightly).
"""

import pytest
import synthetic_video
import torch

import flashcodec
from unifiedserve.engine.inputs import VisionInput
from unifiedserve.engine.llm import LLM, EngineConfig
from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.scheduler import SchedulerConfig

LOGITS_ATOL = 1e-4
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def reference(demo_path, use_released_rope):
    from transformers import Qwen2_5_VLForConditionalGeneration

    # positions by the released M-RoPE rule on both sides (transformers >= 5.3 differs after a video)
    return use_released_rope(Qwen2_5_VLForConditionalGeneration.from_pretrained(demo_path, dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def media(video_factory, image_factory):
    clip = video_factory(codec="h264", suffix=".mp4", width=128, height=96, duration_s=2.0, fps=24.0, gop=12,
                         bframes=2)
    video = flashcodec.decode_video(clip, num_frames=5, height=56, width=84, output="patches")  # odd: padded
    image = flashcodec.decode_image(image_factory(".png", width=97, height=61))
    return {"video": VisionInput.from_video(video), "image": VisionInput.from_image(image)}


def build(engine, parts, text="What is shown?"):
    content = [{"type": kind, "vision": v} for kind, v in parts] + [{"type": "text", "text": text}]
    return engine.build_prompt([{"role": "user", "content": content}])


def run_ours(engine, prompts, record_logits):
    """Generate greedily; return outputs and the logits each request was sampled from, per step."""
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with record_logits(engine) as seen:
        ids = [engine.add_request(p, v, params) for p, v in prompts]
        final = {}
        while engine.has_unfinished:
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = o
    return [final[i] for i in ids], [torch.stack(seen[i]) for i in ids]


CASES = {
    "text": [],
    "image_odd_size": [("image", "image")],
    "video_odd_frames": [("video", "video")],
    "image_and_video": [("image", "image"), ("video", "video")],
}
CHUNKINGS = {
    "unchunked": SchedulerConfig(enable_chunked_prefill=False),
    "chunk_7_encode_1_slice": SchedulerConfig(prefill_token_budget=7, encode_token_budget=1),
    "chunk_13": SchedulerConfig(prefill_token_budget=13, encode_token_budget=30),
    "chunk_64": SchedulerConfig(prefill_token_budget=64),
}


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logits_match(demo_path, reference, media, record_logits, hf_generate, case, chunking):
    engine = LLM(demo_path, EngineConfig(scheduler=CHUNKINGS[chunking]))
    ids, vision = build(engine, [(kind, media[key]) for kind, key in CASES[case]])
    (out,), (logits,) = run_ours(engine, [(ids, vision)], record_logits)
    ref_tokens, ref_logits = hf_generate(reference, ids, vision, NEW_TOKENS)
    assert out.token_ids == ref_tokens
    assert torch.allclose(logits, ref_logits, atol=LOGITS_ATOL, rtol=0), (logits - ref_logits).abs().max()
    assert engine.pool_usage() == {"kv_blocks_used": 0, "patch_pages_used": 0, "visual_pages_used": 0}


def test_batch_of_requests_of_different_lengths(demo_path, reference, media, record_logits, hf_generate):
    engine = LLM(demo_path, EngineConfig(scheduler=SchedulerConfig(prefill_token_budget=20, encode_token_budget=24)))
    prompts = [
        build(engine, [], "Hi"),
        build(engine, [("video", media["video"])], "Tell me everything that happens in this clip, in order."),
        build(engine, [("image", media["image"])]),
        build(engine, [], "A much longer text-only question about the weather, the sea and the hills."),
    ]
    outs, logits = run_ours(engine, prompts, record_logits)
    for (ids, vision), out, ours in zip(prompts, outs, logits):
        ref_tokens, ref_logits = hf_generate(reference, ids, vision, NEW_TOKENS)
        assert out.token_ids == ref_tokens
        assert torch.allclose(ours, ref_logits, atol=LOGITS_ATOL, rtol=0)
    assert engine.pool_usage() == {"kv_blocks_used": 0, "patch_pages_used": 0, "visual_pages_used": 0}




def test_several_images(demo_path, reference, media, image_factory, record_logits, hf_generate):
    second = VisionInput.from_image(flashcodec.decode_image(image_factory(".jpg", width=150, height=90, seed=3)))
    engine = LLM(demo_path, EngineConfig(scheduler=SchedulerConfig(prefill_token_budget=9)))
    ids, vision = build(engine, [("image", media["image"]), ("image", second)], "Compare the two pictures.")
    (out,), (logits,) = run_ours(engine, [(ids, vision)], record_logits)
    ref_tokens, ref_logits = hf_generate(reference, ids, vision, NEW_TOKENS)
    assert out.token_ids == ref_tokens
    assert torch.allclose(logits, ref_logits, atol=LOGITS_ATOL, rtol=0)
