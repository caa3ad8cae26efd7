"""proxy/core/request.py's SUMMARISERS: what each endpoint's body becomes, and the errors bad bodies get."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.fingerprint import Fingerprinter
from proxy.core.request import SUMMARISERS, RequestError, summary_from_openai
from proxy.core.routing_config import AffinityConfig


def test_responses_reads_instructions_tools_and_input_items() -> None:
    s = summary_from_openai("/v1/responses", {
        "model": "m", "instructions": "be brief", "max_output_tokens": 7,
        "tools": [{"type": "function", "name": "f", "parameters": {"b": 1, "a": 2}}],
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                               {"type": "input_image", "image_url": "https://x/1.png"}]},
                  {"type": "function_call", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c", "output": "42"}],
        "previous_response_id": "resp_1"})
    assert s.prompt.startswith("system\nbe brief\ntools\n")
    assert '"a":2,"b":1' in s.prompt  # tool schemas as stable, sorted JSON
    assert "user\nhi\n" in s.prompt and "tool\n42\n" in s.prompt
    assert s.key_prefix_chars == s.prompt.index("user\nhi\n") + len("user\nhi\n")
    assert s.max_tokens == 7 and len(s.media) == 1 and s.session_key == "response:resp_1"
    # a session header wins over the body's
    assert summary_from_openai("/v1/responses", {"input": "x", "previous_response_id": "r"},
                               session_key="h").session_key == "h"


def test_anthropic_messages_read_system_blocks_and_tool_results() -> None:
    s = summary_from_openai("/v1/messages", {
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "sys"}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "result"}]}]}]})
    assert s.prompt == "system\nsys\nuser\nlook\nresult\n"
    assert len(s.media) == 1 and s.max_tokens == 5


def test_the_same_chat_as_openai_and_anthropic_has_the_same_prompt() -> None:
    chat = summary_from_openai("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    msgs = summary_from_openai("/v1/messages", {"system": "s", "messages": [{"role": "user", "content": "u"}]})
    assert (chat.prompt, chat.key_prefix_chars) == (msgs.prompt, msgs.key_prefix_chars)


@pytest.mark.parametrize("path,body,text", [
    ("/v1/rerank", {"query": "q", "documents": ["a", {"text": "b"}]}, "query\nq\na\nb\n"),
    ("/score", {"text_1": "x", "text_2": ["y", "z"]}, "text_1\nx\ntext_2\ny\nz\n"),
    ("/tokenize", {"prompt": "p"}, "p"),
    ("/pooling", {"input": ["a", "b"]}, "a\nb"),
    ("/pooling", {"messages": [{"role": "user", "content": "m"}]}, "user\nm\n"),
])
def test_vllm_endpoints(path: str, body: dict[str, Any], text: str) -> None:
    assert summary_from_openai(path, body).prompt == text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/responses", {}, "input"),
    ("/v1/responses", {"input": 3}, "input"),
    ("/v1/responses", {"input": "x", "instructions": 1}, "instructions"),
    ("/v1/messages", {"messages": []}, "messages"),
    ("/v1/messages", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/rerank", {"query": "q"}, "documents"),
    ("/score", {"text_1": "x"}, "text_2"),
    ("/pooling", {}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": {}}, None),
])
def test_bad_bodies_name_the_field(path: str, body: dict[str, Any], param: str | None) -> None:
    if param is None:  # chat reads no tools (the routing prompt of chat is its messages): not an error
        summary_from_openai(path, body)
        return
    with pytest.raises(RequestError) as err:
        summary_from_openai(path, body)
    assert err.value.param == param


def test_an_image_changes_the_fingerprint_not_the_prompt() -> None:
    def body(url: str) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    a = summary_from_openai("/v1/chat/completions", body("https://x/a.png"))
    b = summary_from_openai("/v1/chat/completions", body("https://x/b.png"))
    fp = Fingerprinter(AffinityConfig())
    assert a.prompt == b.prompt and fp.keys(a).hash_key == fp.keys(b).hash_key
    assert fp.keys(a).fingerprint != fp.keys(b).fingerprint
    assert fp.keys(a).fingerprint == fp.keys(summary_from_openai("/v1/chat/completions", body("https://x/a.png"))).fingerprint


def test_every_table_entry_is_a_path() -> None:
    assert all(p.startswith("/") for p in SUMMARISERS)


@pytest.mark.parametrize("prompt", ["plain text", "", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completions_summary_is_the_summariser_s_whatever_the_prompt(prompt: Any) -> None:
    # A one-string prompt skips the summariser's bookkeeping: the summary must be the one it would give.
    from proxy.core.request import _Content

    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    s = summary_from_openai("/v1/completions", body, session_key="k")
    out = _Content()
    SUMMARISERS["/v1/completions"](body, out)
    assert s.prompt == out.prompt and s.key_prefix_chars is None and s.shared_prefix_chars is None
    assert s.media == () and s.previous_response_id is None and s.session_key == "k" and s.messages is None
    assert summary_from_openai("/v1/completions", body).session_key is None
    # an integer temperature is read as the float it means, a bool is refused as before
    assert s.temperature == 0.0 and type(s.temperature) is float
    assert type(summary_from_openai("/v1/completions", {**body, "temperature": 1}).temperature) is float
    with pytest.raises(RequestError, match="temperature"):
        summary_from_openai("/v1/completions", {**body, "temperature": True})
    with pytest.raises(RequestError, match="'prompt' is required"):
        summary_from_openai("/v1/completions", {"model": "m"})
