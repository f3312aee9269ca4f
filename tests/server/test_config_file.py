"""`conveyor serve --config FILE` (vLLM's YAML file of options) and the model as the command's
first argument (`vllm serve MODEL`): what the file gives reaches the engine and the server, the
command line wins over the file, and a file that is not one is refused by what is wrong."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import httpx
import pytest

from server import cli
from server.cli import engine_config, server_settings
from tests.helpers import chat_tokenizer, tiny_llama
from tests.server_utils import server_process

CONFIG = """\
model: /models/from-the-file
max-model-len: 512
max_num_seqs: 8
enable-prefix-caching: false
enable-auto-tool-choice: true
trust-remote-code: false
tool-call-parser: hermes
served-model-name: [main, alias]
hf-overrides: {rope_theta: 20000.0}
middleware: [tests.server.middleware_examples.StampMiddleware, app.hooks.gate]
"""


def parsed(monkeypatch: pytest.MonkeyPatch, *argv: str) -> argparse.Namespace:
    """The arguments `conveyor serve ARGV` runs the server with (the server not started)."""
    taken: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "serve", lambda args: taken.append(args) or 0)
    assert cli.main(["serve", *argv]) == 0
    return taken[0]


def config_file(tmp_path: Path, text: str = CONFIG) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_a_config_file_gives_serve_its_options(tmp_path, monkeypatch) -> None:
    args = parsed(monkeypatch, "--config", config_file(tmp_path))
    engine, settings = engine_config(args), server_settings(args)
    assert engine.model == "/models/from-the-file"
    assert (engine.max_model_len, engine.max_num_seqs) == (512, 8)
    assert not engine.enable_prefix_caching
    assert engine.hf_overrides == {"rope_theta": 20000.0}
    assert not engine.trust_remote_code
    assert (settings.served_model_name, settings.served_model_aliases) == ("main", ("alias",))
    assert args.enable_auto_tool_choice and settings.tool_call_parser == "hermes"
    # An option given once per value takes the list's values each in turn.
    assert settings.middleware == (
        "tests.server.middleware_examples.StampMiddleware",
        "app.hooks.gate",
    )


def test_the_command_line_wins_over_the_file(tmp_path, monkeypatch) -> None:
    path = config_file(tmp_path)
    for argv in (
        ["--max-num-seqs", "4", "--config", path, "--enable-prefix-caching"],
        [f"--config={path}", "--max-num-seqs", "4", "--enable-prefix-caching"],
    ):
        engine = engine_config(parsed(monkeypatch, *argv))
        assert engine.max_num_seqs == 4 and engine.enable_prefix_caching
        assert engine.max_model_len == 512  # still the file's


def test_the_model_may_come_first_as_with_vllm_serve(tmp_path, monkeypatch) -> None:
    assert parsed(monkeypatch, "/models/first", "--port", "9000").model == "/models/first"
    assert parsed(monkeypatch, "--port", "9000").model is None
    path = config_file(tmp_path)
    assert parsed(monkeypatch, "/models/first", "--config", path).model == "/models/first"
    assert parsed(monkeypatch, "/models/same", "--model", "/models/same").model == "/models/same"
    for twice in (["/models/a", "--model", "/models/b"], ["/models/a", "--model=/models/b"]):
        with pytest.raises(SystemExit):
            parsed(monkeypatch, *twice)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("max-num-seqs: 8\nno-such-option: 1\n", "unknown option 'no-such-option'"),
        ("- max-num-seqs\n- 8\n", "must hold a mapping of options"),
        ("max-num-seqs: [8\n", "not YAML"),
        ("enable-auto-tool-choice: 1\n", "'enable-auto-tool-choice' is a switch"),
        ("config: other.yaml\n", "unknown option 'config'"),
        ("max-num-seqs: eight\n", "invalid int value"),
    ],
)
def test_a_file_that_is_not_one_is_refused_by_what_is_wrong(
    tmp_path, monkeypatch, capsys, text: str, reason: str
) -> None:
    with pytest.raises(SystemExit):
        parsed(monkeypatch, "--config", config_file(tmp_path, text))
    assert reason in capsys.readouterr().err


def test_a_missing_file_or_an_abbreviated_option_is_refused(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parsed(monkeypatch, "--config", str(tmp_path / "missing.yaml"))
    assert "cannot read the file" in capsys.readouterr().err
    # An abbreviation would reach argparse without the file read; both commands also take
    # --config-format, so argparse refuses it as ambiguous (else `main` would).
    for command in (["serve"], ["batch", "run", "in.jsonl", "out.jsonl"]):
        with pytest.raises(SystemExit):
            cli.main([*command, "--conf", config_file(tmp_path)])
        error = capsys.readouterr().err
        assert "ambiguous option: --conf" in error or "write --config in full" in error
    with pytest.raises(SystemExit):
        parsed(monkeypatch, "--config")


@pytest.mark.e2e
def test_a_server_starts_from_its_model_and_a_config_file(tmp_path) -> None:
    """`python -m server FOLDER --config FILE`, as `vllm serve FOLDER --config FILE`."""
    folder = tmp_path / "tiny"
    tiny_llama().save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    config = "served-model-name: [tiny-from-file]\nmax-model-len: 96\n"
    config += "dtype: float32\nkv-cache-memory: 16MiB\n"
    process, url = server_process(str(folder), "--config", config_file(tmp_path, config))
    try:
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m["root"], m["max_model_len"]) for m in models] == [
            ("tiny-from-file", str(folder), 96)
        ]
        body = {"model": "tiny-from-file", "prompt": "hello", "max_tokens": 3}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    finally:
        process.send_signal(signal.SIGTERM)
        log = process.communicate(timeout=60)[0]
    assert process.returncode == 0, log


def test_a_config_file_gives_batch_run_its_options(tmp_path, monkeypatch) -> None:
    """`conveyor batch run IN OUT --config FILE`, as vLLM's run-batch takes one."""
    taken: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "batch_run", lambda args: taken.append(args) or 0)
    path = config_file(tmp_path, "max-model-len: 256\nmax_num_seqs: 3\nmodel: /models/m\n")
    argv = ["batch", "run", "in.jsonl", "out.jsonl", "--config", path, "--max-num-seqs", "5"]
    assert cli.main(argv) == 0
    [args] = taken
    engine = engine_config(args)
    assert (engine.model, engine.max_model_len, engine.max_num_seqs) == ("/models/m", 256, 5)
    assert args.input == Path("in.jsonl")
    with pytest.raises(SystemExit):
        cli.main(
            [
                "batch",
                "run",
                "in.jsonl",
                "out.jsonl",
                "--config",
                config_file(tmp_path, "port: 1\n"),
            ]
        )
