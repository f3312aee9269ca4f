"""A request's own chat template (vLLM's `chat_template` field): refused unless the server
trusts requests with one (`--trust-request-chat-template`), and then used everywhere the
model's would be: the prompt, /tokenize, the render route and the tools' written form. And the
template served, with the rest of the tokenizer's config, at /tokenizer_info."""

from __future__ import annotations

from server.settings import ServerSettings
from tests.helpers import chat_tokenizer, reference_greedy
from tests.server_utils import app_client, shared_tiny_model

# Roles in brackets, no special tokens: another prompt than the model's template writes.
BRACKETS = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi there"}]
TRUSTED = ServerSettings(served_model_name="tiny", trust_request_chat_template=True)


def brackets_ids() -> list[int]:
    return chat_tokenizer()("[user]Hi there[assistant]", add_special_tokens=False)["input_ids"]


async def test_a_request_template_is_refused_unless_the_server_trusts_them():
    async with app_client() as (client, _):
        body = {"messages": MESSAGES, "max_tokens": 2, "chat_template": BRACKETS}
        refused = await client.post("/v1/chat/completions", json=body)
        tokenized = await client.post("/tokenize", json={"messages": MESSAGES, **body})
        plain = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
    for response in (refused, tokenized):
        assert response.status_code == 400
        error = response.json()["error"]
        assert (
            error["param"] == "chat_template"
            and "--trust-request-chat-template" in error["message"]
        )
    assert plain.status_code == 200


async def test_a_trusted_request_template_writes_the_prompt_it_is_run_on():
    async with app_client(TRUSTED) as (client, _):
        body = {
            "messages": MESSAGES,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "chat_template": BRACKETS,
        }
        tokenized = await client.post(
            "/tokenize",
            json={"messages": MESSAGES, "add_generation_prompt": True, "chat_template": BRACKETS},
        )
        rendered = await client.post("/v1/chat/completions/render", json=body)
        reply = await client.post("/v1/chat/completions", json={**body, "return_token_ids": True})
        own = await client.post("/tokenize", json={"messages": MESSAGES})
    expected = brackets_ids()
    assert tokenized.json()["tokens"] == expected
    assert rendered.json()["token_ids"] == expected
    assert own.json()["tokens"] != expected  # the model's own template otherwise
    assert reply.json()["usage"]["prompt_tokens"] == len(expected)
    assert reply.json()["prompt_token_ids"] == expected
    tokens = reply.json()["choices"][0]["token_ids"]
    assert tokens == reference_greedy(shared_tiny_model(), expected, 4)


async def test_a_request_template_without_a_tool_section_gets_the_tools_written_in():
    async with app_client(TRUSTED) as (client, _):
        tool = {"type": "function", "function": {"name": "lookup_weather", "parameters": {}}}
        tokenized = await client.post(
            "/v1/chat/completions/render",
            json={"messages": MESSAGES, "tools": [tool], "chat_template": BRACKETS},
        )
    text = chat_tokenizer().decode(tokenized.json()["token_ids"])
    assert text.startswith("[system]") and "lookup_weather" in text
    assert text.endswith("[user]Hi there[assistant]")


async def test_the_tokenizer_info_route_serves_the_tokenizers_config_when_enabled():
    settings = ServerSettings(served_model_name="tiny", tokenizer_info_endpoint=True)
    async with app_client(settings) as (client, _):
        info = await client.get("/tokenizer_info")
    async with app_client() as (client, _):
        hidden = await client.get("/tokenizer_info")
    assert info.status_code == 200 and hidden.status_code == 404
    tokenizer = chat_tokenizer()
    body = info.json()
    assert body["chat_template"] == tokenizer.chat_template
    assert body["eos_token"] == tokenizer.eos_token and body["tokenizer_class"]


def test_added_tokens_in_the_tokenizer_info_are_their_fields():
    from tokenizers import AddedToken

    from server.tokenization import _json_safe

    held = {5: AddedToken("<x>", special=True), "ids": {1, 2}, "other": object}
    safe = _json_safe(held)
    assert safe["5"]["content"] == "<x>" and safe["5"]["special"] is True
    assert sorted(safe["ids"]) == [1, 2] and safe["other"] == str(object)
