"""Processor: chat template, tokenizer, placeholder expansion, streaming detokenization."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcodec.patches import PatchSpec
from unifiedserve.model import load_processor
from unifiedserve.model.demo import SPECIAL_TOKENS, write_demo_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo"), seed=0)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load_processor(checkpoint)


MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                         {"type": "text", "text": "What is in the video?"}]}]


def test_render_chat_qwen2_vl_format(processor):
    assert processor.render_chat(MESSAGES) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|video_pad|><|vision_end|>What is in the video?<|im_end|>\n"
        "<|im_start|>assistant\n")
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello."}]
    assert processor.render_chat(turns, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n")


def test_render_chat_matches_transformers(checkpoint, processor):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    template = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    for generation_prompt in (True, False):
        ref = tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                            add_generation_prompt=generation_prompt)
        assert processor.render_chat(MESSAGES, add_generation_prompt=generation_prompt) == ref


def test_special_tokens_are_single_ids(processor):
    vocab_size = processor.tokenizer.get_vocab_size()
    assert 1000 <= vocab_size <= 2000
    for token in SPECIAL_TOKENS:
        ids = processor.tokenize(f"a{token}b")
        assert len(ids) == 3 and ids[1] == processor.tokenizer.token_to_id(token)
    assert processor.eos_token_id == processor.tokenizer.token_to_id("<|im_end|>")


@pytest.mark.parametrize("text", ["The quick brown fox.", "Zebras 2026: naïve café — 日本語 ✓ 🙂",
                                  " two  spaces\n"])
def test_tokenize_decode_round_trip(processor, text):
    assert processor.decode(processor.tokenize(text)) == text


def test_expand_vision_tokens(processor):
    ids = processor.tokenize(processor.render_chat(MESSAGES))
    image, video = processor.image_token_id, processor.video_token_id
    expanded = processor.expand_vision_tokens(ids, [(1, 4, 6)], [(3, 6, 10)])
    assert expanded.count(image) == 6 and expanded.count(video) == 45
    assert len(expanded) == len(ids) + 5 + 44
    # The order of everything else is kept.
    assert [t for t in expanded if t not in (image, video)] == [t for t in ids if t not in (image, video)]
    assert processor.expand_vision_tokens(ids, [(1, 4, 4)], [(1, 4, 4)], merge_size=1).count(image) == 16


@pytest.mark.parametrize("images, videos, match", [
    ([], [(1, 4, 4)], "more image placeholders"),
    ([(1, 4, 4), (1, 4, 4)], [(1, 4, 4)], "2 image grids given but the prompt has 1"),
    ([(1, 4, 4)], [(1, 4, 4), (2, 4, 4)], "2 video grids"),
])
def test_expand_vision_tokens_errors(processor, images, videos, match):
    ids = processor.tokenize(processor.render_chat(MESSAGES))
    with pytest.raises(ValueError, match=match):
        processor.expand_vision_tokens(ids, images, videos)


def test_incremental_decoder_streams_multibyte_characters(processor):
    text = "café 日本 🙂!"
    ids = processor.tokenize(text)
    decoder = processor.incremental_decoder()
    pieces = [decoder.step(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # partial characters are held back, never emitted


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1279), max_size=24), st.booleans())
def test_incremental_decoder_equals_full_decode(processor, ids, skip_special):
    ids = [i for i in ids if i < processor.tokenizer.get_vocab_size()]
    decoder = processor.incremental_decoder(skip_special_tokens=skip_special)
    pieces = [decoder.step(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == processor.decode(ids, skip_special_tokens=skip_special)


def test_preprocessor_config(processor):
    assert processor.patch_spec == PatchSpec()
    assert (processor.image_min_pixels, processor.image_max_pixels) == (3136, 12845056)
    assert processor.image_size(61, 97) == (56, 84)
    assert processor.merge_size == 2


def test_transformers5_size_layout_and_missing_files(tmp_path, checkpoint):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    cfg = json.loads((path / "preprocessor_config.json").read_text())
    del cfg["min_pixels"], cfg["max_pixels"]
    cfg["size"] = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 4}
    (path / "preprocessor_config.json").write_text(json.dumps(cfg))
    processor = load_processor(path)
    assert processor.image_size(200, 200) == (56, 56)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json not found"):
        load_processor(path)


def test_token_bytes_spell_the_text_exactly(processor):
    """Byte-level tokens can split a character; their bytes still concatenate to the text's UTF-8."""
    text = "Hello world, café ☕ — 日本語 <|im_end|>"
    ids = processor.tokenize(text)
    assert b"".join(processor.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert any(len(processor.token_bytes(i)) == 1 and processor.token_bytes(i)[0] >= 0x80 for i in ids)
    assert processor.token_bytes(10**9) == b""


def test_a_long_text_is_tokenized_and_decoded_without_holding_the_gil(processor):
    """The server tokenizes on a worker thread: the single-text calls held the GIL throughout (1 MB: 0.66 s in which
    the event loop, and every stream on it, stood still); the batch calls the processor uses let go of it."""
    import threading
    import time

    text = "a b " * 250_000
    ticks, done = [], threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.002)

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.02)
    try:
        marks = [time.perf_counter()]
        ids = processor.tokenize(text)
        marks.append(time.perf_counter())
        text_again = processor.decode(ids, skip_special_tokens=False)
        marks.append(time.perf_counter())
    finally:
        done.set()
        thread.join()
    assert text_again == text and ids == processor.tokenizer.encode(text, add_special_tokens=False).ids
    # held: one tick at most in a call; let go: a tick every few ms of it (here about 0.6 s, then 0.06 s)
    for name, start, end in (("tokenize", marks[0], marks[1]), ("decode", marks[1], marks[2])):
        during = sum(start < t < end for t in ticks)
        assert during >= 5, f"{name}: {during} ticks in {end - start:.3f} s"


def test_a_template_that_refuses_the_messages_is_a_value_error(checkpoint, tmp_path):
    """Templates call transformers' raise_exception (e.g. roles that must alternate): a ValueError here, which the
    server answers with 400, not jinja's UndefinedError (a 500). A template that fails on the messages too."""
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.first %}"
                               "{{ raise_exception('Conversation roles must start with user') }}{% endif %}"
                               "{{ m['content'] + 1 if m['role'] == 'tool' else m['content'] }}{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    processor = load_processor(folder)
    assert processor.render_chat([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(ValueError, match="the chat template refused the messages: Conversation roles must start"):
        processor.render_chat([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="the chat template refused the messages"):
        processor.render_chat([{"role": "tool", "content": "x"}])
    config["chat_template"] = "{% for m in messages %}"  # never closed
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not compile"):
        load_processor(folder).render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("where", ["chat_template.jinja", "chat_template.json"])
def test_the_processors_template_comes_before_the_tokenizer_configs(checkpoint, tmp_path, where):
    """As transformers' processor and vLLM read a multimodal checkpoint: a fine-tune may change only that one."""
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    (folder / where).write_text(template if where.endswith(".jinja") else json.dumps({"chat_template": template}))
    assert load_processor(folder).render_chat([{"role": "user", "content": "hi"}]) == "[user] hi"
    assert load_processor(checkpoint).render_chat([{"role": "user", "content": "hi"}]) != "[user] hi"


def test_templates_get_what_transformers_gives_them(checkpoint, tmp_path):
    """Loop controls, a tojson that writes non-ASCII and <, >, & as they are, and strftime_now: fine-tuned
    templates use them (jinja's own tojson escapes for HTML; without the extension {% break %} does not compile)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "|{{ strftime_now('%Y') | length }}")
    rendered = load_processor(folder).render_chat([{"role": "user", "content": "é <b> & x"},
                                                   {"role": "user", "content": "never"}])
    assert rendered == '{"role": "user", "content": "é <b> & x"}|4'


def test_tokens_that_add_no_text_cost_the_decoder_nothing(processor):
    """Special tokens the output skips and ids past the tokenizer's vocabulary (padding rows) are dropped at once:
    the text is decode(all_ids)'s, and the decoder holds nothing for them (it decoded everything pending again at
    every step: 32k forced specials took seconds of the server's event loop)."""
    words = processor.tokenize("hello world")
    im_start = processor.tokenizer.token_to_id("<|im_start|>")
    ids = words[:1] + [im_start] * 5000 + [1270] * 100 + words[1:]
    decoder = processor.incremental_decoder()
    pieces = []
    for t in ids:
        pieces.append(decoder.step(t))
        assert len(decoder._ids) <= len(words)
    assert "".join(pieces) + decoder.flush() == processor.decode(ids) == "hello world"
    shown = processor.incremental_decoder(skip_special_tokens=False)  # not skipped: they are text
    text = "".join(shown.step(t) for t in words[:1] + [im_start] * 3) + shown.flush()
    assert text == processor.decode(words[:1] + [im_start] * 3, skip_special_tokens=False)


def test_bytes_that_never_complete_a_character_are_emitted_after_a_bound(processor):
    """A client's logit_bias can force a lone UTF-8 continuation byte forever: after MAX_PENDING such tokens the
    decoder emits what they decode to (U+FFFD) rather than decoding an ever longer tail at every step."""
    from unifiedserve.model.processor import MAX_PENDING

    byte = processor.tokenize("é")  # the demo tokenizer: two byte tokens
    continuation = byte[-1] if len(byte) > 1 else pytest.skip("'é' is one token in this tokenizer")
    decoder = processor.incremental_decoder()
    pieces = [decoder.step(continuation) for _ in range(10 * MAX_PENDING)]
    assert len(decoder._ids) - decoder._read < MAX_PENDING  # pending stays bounded
    assert sum(1 for p in pieces if p) >= 9 and set("".join(pieces)) == {"\ufffd"}
    assert "".join(pieces) + decoder.flush() == processor.decode([continuation] * 10 * MAX_PENDING)
