"""/openapi.json tells the truth: the status codes, error body and content types the server
really sends, and the ranges it really accepts, checked by schemathesis against a live server."""

from __future__ import annotations

import asyncio
import shutil

import jsonschema
import pytest

from server.app import build_app
from server.settings import ServerSettings
from tests.server_utils import app_client, live_server, tiny_engine


def test_the_document_lists_400s_in_openais_shape_and_no_422():
    schema = build_app(tiny_engine(), ServerSettings(api_key="k")).openapi()
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in completions and "HTTPValidationError" not in schema["components"]["schemas"]
    assert {"200", "400", "401", "404", "500", "503", "504"} <= set(completions)
    assert completions["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ErrorResponse"
    )
    assert "text/event-stream" in completions["200"]["content"]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"minimum": 1, "type": "integer"} in fields["max_tokens"]["anyOf"]
    assert fields["n"]["maximum"] == 128


async def test_each_streamed_event_fits_the_documented_event():
    """A stream's events as schemathesis reads them (`data`, `event`) fit the event schema, and
    the stream, their sequence, fits the body's."""
    async with app_client() as (client, _):
        schema = client._transport.app.openapi()  # type: ignore[attr-defined]
        content = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
        event_schema = content["text/event-stream"]["itemSchema"]
        body = {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "stream": True,
            "logprobs": True,
        }
        response = await client.post("/v1/chat/completions", json=body)
        blocks = response.text.strip().split("\n\n")
        assert len(blocks) >= 3
        events = [{"data": block.removeprefix("data: "), "event": "message"} for block in blocks]
        for event in events:
            jsonschema.validate(event, event_schema)
        jsonschema.validate(events, content["text/event-stream"]["schema"])


# Left out: `positive_data_acceptance` (rules a schema cannot state: token ids below the
# vocabulary size, continue_final_message with add_generation_prompt, best_of equal to n) and
# `not_a_server_error` (a deadline the server cannot meet is a 504 by design; the hostile-client
# and step-isolation tests cover 500s).
EXCLUDED = "positive_data_acceptance,not_a_server_error"


@pytest.mark.skipif(shutil.which("st") is None, reason="needs schemathesis (a dev extra)")
async def test_schemathesis_finds_the_server_as_documented(tmp_path):
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    async with live_server(settings) as server:
        process = await asyncio.create_subprocess_exec(
            "st",
            "run",
            f"{server.url}/openapi.json",
            "--seed",
            "1",
            "--max-examples",
            "25",
            "--request-timeout",
            "20",
            # No examples replayed from earlier runs: the same cases on every machine.
            "--generation-database",
            "none",
            "--exclude-checks",
            EXCLUDED,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await process.communicate()
    assert process.returncode == 0, output.decode(errors="replace")[-6000:]
