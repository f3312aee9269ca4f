"""What a deployment plugs in by vLLM's flags: its own ASGI middleware (`--middleware`) and its
own logging configuration (`--log-config-file`)."""

from __future__ import annotations

import json
import logging

import pytest

from server.cli import build_parser, serve, server_settings
from server.log_format import apply_config_file
from server.settings import ServerSettings
from server.user_middleware import resolve
from tests.server import middleware_examples
from tests.server_utils import app_client

EXAMPLES = "tests.server.middleware_examples"
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def with_middleware(*names: str) -> ServerSettings:
    argv = ["serve", "--served-model-name", "tiny"]
    for name in names:
        argv += ["--middleware", f"{EXAMPLES}.{name}"]
    return server_settings(build_parser().parse_args(argv))


async def test_a_class_and_a_function_wrap_every_request():
    settings = with_middleware("StampMiddleware", "tenant_gate")
    assert settings.middleware == (f"{EXAMPLES}.StampMiddleware", f"{EXAMPLES}.tenant_gate")
    middleware_examples.SEEN.clear()
    async with app_client(settings) as (client, _):
        served = await client.post("/v1/completions", json=COMPLETION, headers={"x-tenant": "a"})
        assert served.status_code == 200, served.text
        assert served.headers["x-stamp"] == "class"
        assert middleware_examples.SEEN == ["a"]
        # The function, given second, wraps the class: its own answer passes the class by,
        # and still gets an id and is counted.
        refused = await client.post("/v1/completions", json=COMPLETION)
        assert refused.status_code == 403 and refused.json()["error"]["message"] == "no tenant"
        assert refused.headers["x-request-id"] and "x-stamp" not in refused.headers
        metrics = (await client.get("/metrics", headers={"x-tenant": "ops"})).text
        # Answered before routing: counted under no route's template.
        assert 'http_requests_total{handler="none",method="POST",status="4xx"} 1.0' in metrics


async def test_without_the_flag_nothing_is_added():
    async with app_client(with_middleware()) as (client, _):
        response = await client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 200 and "x-stamp" not in response.headers


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("nomodule", "give a module and a name"),
        ("tests.server.no_such_module.Thing", "cannot import tests.server.no_such_module"),
        (f"{EXAMPLES}.Missing", "has no Missing"),
    ],
)
def test_a_path_that_names_nothing_is_refused(path, reason):
    with pytest.raises(ValueError, match=reason):
        resolve(path)


async def test_what_is_neither_class_nor_async_function_stops_the_start():
    with pytest.raises(ValueError, match="neither an ASGI middleware class nor an async"):
        async with app_client(with_middleware("not_middleware")):
            pass


@pytest.fixture
def logging_restored():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    named = logging.getLogger("conveyor.test.hooks")
    yield named
    root.handlers, root.level = handlers, level
    named.handlers, named.propagate, named.level = [], True, logging.NOTSET


def test_a_log_config_file_configures_every_logger(tmp_path, logging_restored):
    lines = tmp_path / "conveyor.log"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"bare": {"format": "%(levelname)s|%(name)s|%(message)s"}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(lines), "formatter": "bare"}
        },
        "loggers": {"conveyor.test.hooks": {"handlers": ["file"], "level": "WARNING"}},
    }
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    args = build_parser().parse_args(["serve", "--log-config-file", str(path)])
    assert apply_config_file(args.log_config_file) == config  # what uvicorn is given too
    logging_restored.info("below the level")
    logging_restored.warning("written")
    for handler in logging_restored.handlers:
        handler.close()
    assert lines.read_text().splitlines() == ["WARNING|conveyor.test.hooks|written"]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{", "cannot read the log config file"),
        ("[1]", "must hold a JSON object"),
        ('{"version": 7}', "does not configure logging"),
    ],
)
def test_a_log_config_file_that_cannot_apply_stops_the_start(
    tmp_path, logging_restored, caplog, text, reason
):
    path = tmp_path / "logging.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=reason):
        apply_config_file(path)
    args = build_parser().parse_args(["serve", "--log-config-file", str(path)])
    with caplog.at_level(logging.ERROR):
        assert serve(args) == 2  # before any model loads
    assert reason in caplog.text
