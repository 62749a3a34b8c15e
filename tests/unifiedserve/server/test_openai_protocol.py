"""The request models' reading of OpenAI's JSON, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from unifiedserve.server.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                 TokenizeRequest)

MESSAGES = [{"role": "user", "content": "hi"}]


def test_null_in_an_optional_field_is_its_default():
    """OpenAI's optional fields are nullable: "stream": null is no stream, "n": null one choice; a field that takes
    null keeps it ("max_tokens": null on legacy completions is the server's default length, as vLLM reads it)."""
    chat = ChatCompletionRequest.model_validate({
        "messages": MESSAGES, "stream": None, "n": None, "logprobs": None, "max_tokens": None, "min_tokens": None,
        "ignore_eos": None, "skip_special_tokens": None, "stop": None, "tools": None, "store": None})
    assert (chat.stream, chat.n, chat.logprobs, chat.max_tokens, chat.min_tokens) == (False, 1, False, None, 0)
    assert chat.skip_special_tokens is True and chat.ignore_eos is False
    completion = CompletionRequest.model_validate({"prompt": "x", "echo": None, "max_tokens": None, "n": None})
    assert (completion.echo, completion.max_tokens, completion.n) == (False, None, 1)
    assert CompletionRequest.model_validate({"prompt": "x"}).max_tokens == 16  # left out: OpenAI's 16
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///a.png", "detail": None}}]}]})
    assert chat.messages[0].content[0].image_url.detail is None
    tokenize = TokenizeRequest.model_validate({"prompt": "x", "add_special_tokens": None})
    assert tokenize.add_special_tokens is False


@pytest.mark.parametrize("model, body", [
    (ChatCompletionRequest, {"messages": None}),
    (CompletionRequest, {"prompt": None}),
    (DetokenizeRequest, {"tokens": None}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}),
])
def test_null_in_a_required_field_stays_an_error(model, body):
    with pytest.raises(ValidationError):
        model.model_validate(body)


def test_null_is_not_a_value_of_another_type():
    """Only null means the default: a string where a bool goes is still refused (no coercion)."""
    with pytest.raises(ValidationError, match="stream"):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "stream": "true"})
    with pytest.raises(ValidationError, match="not supported"):  # an unsupported field's non-neutral value
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [{"type": "function"}]})


def test_best_of_must_cover_n():
    """best_of is taken only as 1 (one candidate per choice); with n above it, OpenAI and vLLM refuse it."""
    assert CompletionRequest.model_validate({"prompt": "x", "best_of": 1}).n == 1
    assert CompletionRequest.model_validate({"prompt": "x", "best_of": None, "n": 2}).n == 2
    with pytest.raises(ValidationError, match=r"best_of \(1\) must be at least n \(2\)"):
        CompletionRequest.model_validate({"prompt": "x", "best_of": 1, "n": 2})
    with pytest.raises(ValidationError, match="best_of is not supported"):
        CompletionRequest.model_validate({"prompt": "x", "best_of": 3, "n": 2})


def test_the_developer_role_reaches_the_template_as_system(tmp_path):
    """OpenAI's newer name for the system instructions: Qwen2.5-VL was trained with "system" (and its template adds
    its default system prompt before a first message that is not one)."""
    from unifiedserve.server.media import MediaPolicy
    from unifiedserve.server.prompts import convert_messages

    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "Be terse."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]}]})
    messages, media = convert_messages(body, MediaPolicy(tmp_path))
    assert [m["role"] for m in messages] == ["system", "user", "system"] and media == []
    assert messages[0]["content"] == "Be terse." and \
        messages[2]["content"] == [{"type": "text", "text": "Answer in French."}]


@pytest.mark.parametrize("stop", ["", ["a", ""]])
def test_an_empty_stop_string_is_refused_by_the_schema(stop):
    """Before any media is probed (the sampling parameters refused it only after)."""
    with pytest.raises(ValidationError, match="stop strings must not be empty"):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "stop": stop})
