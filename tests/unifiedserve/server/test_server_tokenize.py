"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` through the whole server: a prompt's ids as
``/v1/completions`` reads them, messages' ids as ``/v1/chat/completions`` prefills them (visual tokens
expanded from the probe, nothing decoded), and clear errors."""

from __future__ import annotations

import signal

import pytest

from serve_helpers import Server, http
from unifiedserve.model.processor import load_processor

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def server(clip_dir):
    srv = Server("--max-model-len", str(MAX_MODEL_LEN), media_dir=clip_dir)
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.log()


@pytest.fixture(scope="module")
def processor():
    from unifiedserve.model.demo import DEFAULT_DEMO_PATH

    return load_processor(DEFAULT_DEMO_PATH)


def video_messages(clip_dir, question="What happens?", **options):
    return [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": f"file://{clip_dir / 'clip.mp4'}", **options}},
        {"type": "text", "text": question}]}]


def tokenize(server, body, status=200):
    got, answer = http("POST", server.url + "/tokenize", body)
    assert got == status, answer
    return answer


def test_a_prompt_is_tokenized_as_completions_read_it(server, processor):
    text = "The lighthouse keeper opened the door"
    answer = tokenize(server, {"prompt": text, "return_token_strs": True})
    ids = processor.tokenize(text)
    assert answer == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                      "token_strs": [processor.tokenizer.id_to_token(i) for i in ids]}
    got, completion = http("POST", server.url + "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert got == 200 and completion["usage"]["prompt_tokens"] == answer["count"]
    assert http("POST", server.url + "/detokenize", {"tokens": ids}) == (200, {"prompt": text})
    assert tokenize(server, {"prompt": text})["token_strs"] is None


def test_messages_count_what_chat_prefills_visual_tokens_included(server, clip_dir, processor):
    """The count of a video question equals the chat endpoint's ``usage.prompt_tokens``; its video tokens are
    the probe's grid; vision holds nothing afterwards."""
    for messages in (video_messages(clip_dir), video_messages(clip_dir, fps=1.0),
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]):
        answer = tokenize(server, {"messages": messages})
        got, chat = http("POST", server.url + "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
        assert got == 200, chat
        assert answer["count"] == chat["usage"]["prompt_tokens"] == len(answer["tokens"])
    two_fps = tokenize(server, {"messages": video_messages(clip_dir)})["tokens"]
    one_fps = tokenize(server, {"messages": video_messages(clip_dir, fps=1.0)})["tokens"]
    pads = two_fps.count(processor.video_token_id)
    # 4 s at 2 fps: 8 frames, 4 temporal patches; at 1 fps half of them, of the same picture size
    assert pads > 0 and one_fps.count(processor.video_token_id) * 2 == pads
    server.wait_idle()
    vision = {k: v for k, v in server.metrics().items() if "vision" in k and ("requests" in k or "ahead" in k)}
    assert vision and not any(vision.values()), vision


def test_the_generation_prompt_and_detokenize_round_trip(server, processor):
    messages = [{"role": "user", "content": "Hi"}]
    with_prompt = tokenize(server, {"messages": messages})["tokens"]
    without = tokenize(server, {"messages": messages, "add_generation_prompt": False})["tokens"]
    assert with_prompt[:len(without)] == without and len(with_prompt) > len(without)
    text = http("POST", server.url + "/detokenize", {"tokens": with_prompt})[1]["prompt"]
    assert text == processor.render_chat(messages) and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("path,body,status,needle", [
    ("/tokenize", {}, 400, "send either prompt or messages"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "either prompt or messages"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, 400, "applies to messages"),
    ("/tokenize", {"prompt": "a", "chat_template": "x"}, 400, "unknown field"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "does not exist"),
    ("/tokenize", {"prompt": "x" * (32 * MAX_MODEL_LEN + 1)}, 400, "characters; this server accepts at most"),
    ("/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "file:///etc/passwd"}}]}]}, 400, "outside"),
    ("/tokenize", {"messages": [{"role": "user", "content": "look <|video_pad|>"}]}, 400, "<|video_pad|>"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "Token id 1000000 outside the vocabulary"),
    ("/detokenize", {"tokens": [1, 1260]}, 400, "Token id 1260 outside the vocabulary (ids 0..1252)"),
    ("/detokenize", {"tokens": [-1]}, 400, "greater than or equal to 0"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "does not exist"),
])
def test_bad_requests_are_a_clear_4xx(server, path, body, status, needle):
    got, answer = http("POST", server.url + path, body)
    assert got == status and needle in answer["error"]["message"], answer


def test_a_video_over_the_context_is_refused_with_its_count(server, clip_dir):
    big = video_messages(clip_dir, fps=4.0, min_pixels=640 * 480, max_pixels=640 * 480)  # 8 x 392 visual tokens
    answer = tokenize(server, {"messages": big}, status=400)
    message = answer["error"]["message"]
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message and "visual tokens" in message
    server.wait_idle()


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "word " * 1500}, "but the prompt alone needs"),
    ({"messages": [{"role": "user", "content": "word " * 1500}]}, "but the messages alone need"),
])
def test_text_over_the_context_is_refused_with_its_count_as_media_is(server, body, needle):
    """The same bound with or without media (until 2026-11-27 only a video's count was refused)."""
    answer = tokenize(server, body, status=400)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens, {needle}" in answer["error"]["message"], answer
