"""vLLM's serve flags that command lines copied from it carry: several served model names,
`--chat-template` (a file or the template itself), `--enable-auto-tool-choice`,
`--enable-log-requests` / `--disable-log-requests`, `--limit-mm-per-prompt` and
`--allowed-media-domains`."""

from __future__ import annotations

import logging

import pytest

from server.cli import build_parser, server_settings
from server.log_format import PlainFormatter
from tests.server_utils import app_client

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>>"
HELLO = [{"role": "user", "content": "hello"}]


def settings_of(*argv: str):
    return server_settings(build_parser().parse_args(["serve", *argv]))


async def test_every_served_name_reaches_the_model_and_replies_give_the_first():
    settings = settings_of("--served-model-name", "main", "alias")
    assert (settings.served_model_name, settings.served_model_aliases) == ("main", ("alias",))
    async with app_client(settings) as (client, _):
        listed = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        assert listed == ["main", "alias"]
        body = {"model": "alias", "prompt": "hi", "max_tokens": 2}
        reply = await client.post("/v1/completions", json=body)
        assert reply.status_code == 200 and reply.json()["model"] == "main"
        body["model"] = "other"
        assert (await client.post("/v1/completions", json=body)).status_code == 404


@pytest.mark.parametrize("form", ["file", "inline"])
async def test_a_chat_template_replaces_the_models_own(tmp_path, form):
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    given = str(file) if form == "file" else TEMPLATE.replace("\n", "\\n")
    settings = settings_of("--chat-template", given, "--enable-auto-tool-choice")
    assert settings.chat_template == TEMPLATE
    async with app_client(settings) as (client, engine):
        rendered = await client.post("/v1/chat/completions/render", json={"messages": HELLO})
        expected = engine.tokenizer.encode("[user] hello\n>>", add_special_tokens=False)
        assert rendered.json()["token_ids"] == expected


def test_a_chat_template_that_is_neither_file_nor_template_is_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chat-template", "/no/such/template.jinja"])


def test_request_log_lines_follow_vllms_flags_in_either_format():
    assert not settings_of().log_requests
    assert settings_of("--log-format", "json").log_requests
    assert not settings_of("--log-format", "json", "--disable-log-requests").log_requests
    assert settings_of("--enable-log-requests").log_requests
    record = logging.LogRecord("conveyor.requests", logging.INFO, "", 0, "request", None, None)
    record.fields = {"request_id": "r-1", "prompt_tokens": 3, "finish_reasons": ["stop"]}
    line = PlainFormatter("%(name)s: %(message)s").format(record)
    assert (
        line
        == 'conveyor.requests: request request_id="r-1" prompt_tokens=3 finish_reasons=["stop"]'
    )


def test_the_image_limit_takes_vllms_json_and_refuses_other_media():
    assert settings_of().limits.max_images == 16
    assert settings_of("--limit-mm-per-prompt", '{"image": 2}').limits.max_images == 2
    for bad in ('{"video": 1}', '{"image": -1}', '{"image": "2"}', "2"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--limit-mm-per-prompt", bad])


def test_the_allowed_media_domains_are_read_as_lower_case_hosts():
    assert settings_of().limits.allowed_media_domains is None
    limits = settings_of("--allowed-media-domains", "Images.Example", "cdn.example").limits
    assert limits.allowed_media_domains == frozenset({"images.example", "cdn.example"})
