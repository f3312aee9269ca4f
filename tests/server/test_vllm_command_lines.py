"""vLLM's serve flags that command lines copied from it carry: several served model names,
`--chat-template` (a file or the template itself), `--enable-auto-tool-choice`,
`--enable-log-requests` / `--disable-log-requests`, `--limit-mm-per-prompt` and
`--allowed-media-domains`, HTTPS (`--ssl-*`), `--root-path`, `--uvicorn-log-level`,
`--disable-uvicorn-access-log`, `--disable-fastapi-docs`, `--enable-force-include-usage`,
`--return-tokens-as-token-ids`, `--chat-template-content-format`, `--response-role`,
`--tokenizer-mode`, and the flags recipes carry that have nothing to set here (accepted at
Conveyor's own values, refused by name otherwise)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from urllib.parse import urlsplit

import httpx
import pytest

from engine.core.config import EngineConfig
from engine.core.speculation import SpeculativeConfig
from server.app import build_app
from server.cli import build_parser, engine_config, server_settings
from server.http_protocol import uvicorn_config
from server.lifecycle import DrainingServer
from server.log_format import PlainFormatter, configure_logging
from tests.server_utils import app_client, live_server, sse_events, tiny_engine

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


@pytest.fixture(scope="module")
def authority(tmp_path_factory):
    """A certificate authority, and a server certificate of it for 127.0.0.1 in files."""
    import trustme

    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    server.private_key_pem.write_to_path(str(folder / "key.pem"))
    server.cert_chain_pems[0].write_to_path(str(folder / "cert.pem"))
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    return ca, folder


def tls_flags(folder, *more: str, key: str = "key.pem") -> list[str]:
    return ["--ssl-keyfile", str(folder / key), "--ssl-certfile", str(folder / "cert.pem"), *more]


async def test_https_serves_with_the_given_certificate_and_refuses_plain_http(authority):
    _, folder = authority
    async with live_server(settings_of(*tls_flags(folder))) as server:
        assert server.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(folder / "ca.pem"))
        async with httpx.AsyncClient(verify=context) as client:
            reply = await client.get(f"{server.url}/v1/models")
            assert reply.status_code == 200 and reply.json()["data"]
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.HTTPError):
                await client.get(server.url.replace("https://", "http://") + "/health")


async def test_clients_must_show_a_certificate_of_the_authority_when_required(authority):
    ca, folder = authority
    flags = tls_flags(folder, "--ssl-ca-certs", str(folder / "ca.pem"), "--ssl-cert-reqs", "2")
    client_cert = ca.issue_cert("client.example")
    async with live_server(settings_of(*flags)) as server:
        anonymous = ssl.create_default_context(cafile=str(folder / "ca.pem"))
        async with httpx.AsyncClient(verify=anonymous) as client:
            with pytest.raises(httpx.HTTPError):
                (await client.get(f"{server.url}/health")).raise_for_status()
        known = ssl.create_default_context(cafile=str(folder / "ca.pem"))
        client_cert.configure_cert(known)
        async with httpx.AsyncClient(verify=known) as client:
            assert (await client.get(f"{server.url}/health")).status_code == 200


async def test_https_offers_the_ciphers_named(authority):
    """`--ssl-ciphers` (TLS 1.2's; 1.3 has its own suites): a client that shares none of them
    cannot connect."""
    _, folder = authority
    flags = tls_flags(folder, "--ssl-ciphers", "ECDHE+AESGCM")
    async with live_server(settings_of(*flags)) as server:
        for ciphers, served in (("ECDHE+AESGCM", True), ("ECDHE+CHACHA20", False)):
            context = ssl.create_default_context(cafile=str(folder / "ca.pem"))
            context.maximum_version = ssl.TLSVersion.TLSv1_2
            context.set_ciphers(ciphers)
            async with httpx.AsyncClient(verify=context) as client:
                if served:
                    assert (await client.get(f"{server.url}/health")).status_code == 200
                else:
                    with pytest.raises(httpx.ConnectError):
                        await client.get(f"{server.url}/health")
    with pytest.raises(ValueError, match="--ssl-ciphers 'NO-SUCH-CIPHER'"):
        settings_of(*tls_flags(folder, "--ssl-ciphers", "NO-SUCH-CIPHER"))


async def served_certificate(url: str, cafile: str) -> bytes:
    """The certificate a new connection to `url` is shown (DER)."""
    parts = urlsplit(url)
    context = ssl.create_default_context(cafile=cafile)
    _, writer = await asyncio.open_connection(parts.hostname, parts.port, ssl=context)
    certificate = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return certificate


async def test_a_certificate_rotated_on_disk_serves_without_a_restart(authority, tmp_path):
    """`--enable-ssl-refresh`: new connections get the new certificate once its files change;
    a half-written rotation (a key that does not match yet) leaves the old one serving."""
    ca, folder = authority
    for name in ("key.pem", "cert.pem"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    settings = settings_of(*tls_flags(tmp_path, "--enable-ssl-refresh"))
    assert settings.tls is not None and settings.tls.refresh
    app = build_app(tiny_engine(), settings)
    config = uvicorn_config(app, "127.0.0.1", 0, "warning", settings)
    server = DrainingServer(config, app, 1.0, settings.tls, refresh_seconds=0.05)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        url, cafile = f"https://127.0.0.1:{port}", str(folder / "ca.pem")
        first = await served_certificate(url, cafile)
        assert first == ssl.PEM_cert_to_DER_cert((folder / "cert.pem").read_text())
        watcher = server.certificates
        assert watcher is not None and watcher.reloads == 0
        renewed = ca.issue_cert("127.0.0.1")
        renewed.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))  # key still old
        assert not watcher.check() and await served_certificate(url, cafile) == first
        renewed.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
        while watcher.reloads == 0:  # the poll picks it up
            await asyncio.sleep(0.05)
        second = await served_certificate(url, cafile)
        assert second != first
        assert second == ssl.PEM_cert_to_DER_cert(renewed.cert_chain_pems[0].bytes().decode())
    finally:
        server.should_exit = True
        await task


def test_tls_files_are_read_before_the_model_loads(authority, tmp_path):
    _, folder = authority
    with pytest.raises(ValueError, match="both --ssl-keyfile and --ssl-certfile"):
        settings_of("--ssl-keyfile", str(folder / "key.pem"))
    with pytest.raises(ValueError, match="cannot read the TLS files"):
        settings_of(*tls_flags(folder, key="ca.pem"))  # a certificate is not the key
    with pytest.raises(ValueError, match="cannot read the TLS files"):
        settings_of(*tls_flags(folder, "--ssl-ca-certs", str(tmp_path / "absent.pem")))


async def test_a_root_path_names_the_proxy_s_prefix():
    """`--root-path` (a proxy serves the app under `/llm` and strips it, as uvicorn and FastAPI
    take it): the routes answer as ever, and the API description and its page name the prefix,
    so that their links go through the proxy."""
    settings = settings_of("--root-path", "/llm")
    async with live_server(settings) as server, httpx.AsyncClient() as client:
        assert (await client.get(f"{server.url}/v1/models")).status_code == 200
        described = (await client.get(f"{server.url}/openapi.json")).json()
        assert described["servers"] == [{"url": "/llm"}]
        assert "/llm/openapi.json" in (await client.get(f"{server.url}/docs")).text


def test_uvicorn_s_level_is_its_own_or_the_server_s(monkeypatch):
    """`--uvicorn-log-level` sets uvicorn's loggers apart from Conveyor's `--log-level`."""
    config = configure_logging("info", "json", "warning")
    assert config is not None
    assert {spec["level"] for spec in config["loggers"].values()} == {"WARNING"}
    config = configure_logging("debug", "json")
    assert config is not None
    assert {spec["level"] for spec in config["loggers"].values()} == {"DEBUG"}
    args = build_parser().parse_args(["serve", "--uvicorn-log-level", "trace"])
    assert args.uvicorn_log_level == "trace"


async def test_the_api_description_and_its_pages_can_be_turned_off():
    for argv, status in (((), 200), (("--disable-fastapi-docs",), 404)):
        async with app_client(settings_of(*argv)) as (client, _):
            for path in ("/openapi.json", "/docs", "/redoc"):
                assert (await client.get(path)).status_code == status, (argv, path)
            assert (await client.get("/v1/models")).status_code == 200


def test_probes_and_scrapes_can_be_left_out_of_the_access_log():
    """`--disable-access-log-for-endpoints`: uvicorn's lines for those paths (whatever the query
    string, under the root path too) are dropped, the others kept."""
    settings = settings_of(
        "--disable-access-log-for-endpoints", "/health,/metrics", "--root-path", "/llm"
    )
    assert settings.quiet_paths == ("/health", "/metrics")
    uvicorn_config(None, "127.0.0.1", 0, "info", settings)
    access = logging.getLogger("uvicorn.access")

    def kept(path: str) -> bool:
        args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
        record = access.makeRecord(
            access.name, logging.INFO, "h", 1, '%s - "%s %s HTTP/%s" %d', args, None
        )
        return bool(access.filter(record))

    assert not kept("/health") and not kept("/metrics?name=x") and not kept("/llm/health")
    assert kept("/v1/models") and kept("/healthz")
    uvicorn_config(None, "127.0.0.1", 0, "info", settings_of())
    assert kept("/health")  # a server without the flag logs them all again


def test_uvicorn_s_line_per_request_can_be_turned_off():
    for argv, lines in (((), True), (("--disable-uvicorn-access-log",), False)):
        config = uvicorn_config(None, "127.0.0.1", 0, "info", settings_of(*argv))
        assert config.access_log is lines


async def test_a_server_can_give_every_streamed_request_its_usage():
    body = {"prompt": "Hello", "max_tokens": 3, "stream": True, "temperature": 0}
    for argv, usage in (((), False), (("--enable-force-include-usage",), True)):
        async with app_client(settings_of(*argv)) as (client, _):
            reply = await client.post("/v1/completions", json=body)
            chunks = [event for event in sse_events(reply.text) if event != "[DONE]"]
            assert (chunks[-1].get("usage") is not None) is usage, argv
            if usage:
                assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_a_server_can_name_every_logprob_s_token_by_its_id():
    body = {"prompt": "Hello", "max_tokens": 3, "logprobs": 1, "temperature": 0}
    async with app_client(settings_of("--return-tokens-as-token-ids")) as (client, _):
        tokens = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        assert all(t.startswith("token_id:") for t in tokens["logprobs"]["tokens"])


# A template for OpenAI's list of parts: it loops over each message's content (the newline
# after a block tag goes, as transformers renders templates).
PARTS_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]"
    "{% for part in m['content'] %}{{ part['text'] }}|{% endfor %}\n{% endfor %}>>"
)
TWO_PARTS = [
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
]


@pytest.mark.parametrize(
    ("template", "flag", "rendered"),
    [
        (PARTS_TEMPLATE, "auto", "[user]a|b|>>"),
        (PARTS_TEMPLATE, "openai", "[user]a|b|>>"),
        (TEMPLATE, "auto", "[user] ab\n>>"),
        (TEMPLATE, "string", "[user] ab\n>>"),
    ],
)
async def test_the_content_goes_to_the_template_in_the_form_it_reads(template, flag, rendered):
    """`--chat-template-content-format`: `auto` gives parts to a template that loops over a
    message's content, a string to one that prints it; a string or parts sent alike."""
    settings = settings_of("--chat-template", template, "--chat-template-content-format", flag)
    async with app_client(settings) as (client, engine):
        expected = engine.tokenizer.encode(rendered, add_special_tokens=False)
        for messages in (TWO_PARTS, [{"role": "user", "content": "ab"}]):
            if template is PARTS_TEMPLATE and isinstance(messages[0]["content"], str):
                expected = engine.tokenizer.encode("[user]ab|>>", add_special_tokens=False)
            reply = await client.post("/v1/chat/completions/render", json={"messages": messages})
            assert reply.json()["token_ids"] == expected, messages


def test_content_formats_are_vllm_s():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chat-template-content-format", "parts"])
    assert settings_of().chat_content_format == "auto"


async def test_replies_take_the_response_role_under_a_generation_prompt():
    """`--response-role`: the role of a reply after the template's generation prompt; a reply
    that continues the last message takes that message's role, as vLLM's does."""
    async with app_client(settings_of("--response-role", "bot")) as (client, _):
        body = {"messages": HELLO, "max_tokens": 2, "temperature": 0}
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.json()["choices"][0]["message"]["role"] == "bot"
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        first = next(iter(sse_events(streamed.text)))
        assert first["choices"][0]["delta"]["role"] == "bot"
        prefix = [*HELLO, {"role": "assistant", "content": "Sure"}]
        continued = {**body, "messages": prefix, "add_generation_prompt": False}
        continued["continue_final_message"] = True
        reply = await client.post("/v1/chat/completions", json=continued)
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"
    async with app_client(settings_of()) as (client, _):
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"


def test_the_tokenizer_mode_takes_vllm_s_names():
    def mode(*argv: str) -> str:
        return engine_config(build_parser().parse_args(["serve", *argv])).tokenizer_mode

    assert mode() == "auto" and mode("--tokenizer-mode", "hf") == "auto"
    assert mode("--tokenizer-mode", "slow") == "slow"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tokenizer-mode", "mistral"])


# A recipe's command line: flags with nothing to set here, at the values Conveyor serves.
RECIPE = [
    "--swap-space", "16", "--disable-custom-all-reduce", "--distributed-executor-backend", "mp",
    "--max-parallel-loading-workers", "2", "--enable-prompt-tokens-details",
    "--pipeline-parallel-size", "1", "-dp", "1", "--guided-decoding-backend", "xgrammar",
    "--structured-outputs-config", '{"backend": "auto"}', "--enable-request-id-headers",
    "-O3", "--compilation-config", '{"level": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}',
    "--max-seq-len-to-capture", "8192", "--enable-expert-parallel", "--mm-encoder-tp-mode", "data",
    "--api-server-count", "1", "--num-scheduler-steps", "1", "--preemption-mode", "recompute",
    "--disable-frontend-multiprocessing", "--use-v2-block-manager", "--disable-cascade-attn",
    "--kv-sharing-fast-prefill", "--fully-sharded-loras", "--max-cpu-loras", "4",
    "--enable-server-load-tracking", "--log-error-stack", "--config-format", "hf",
    "--safetensors-load-strategy", "lazy", "--prefix-caching-hash-algo", "sha256",
    "--no-use-tqdm-on-load", "--mm-processor-cache-gb", "0", "--skip-mm-profiling",
]  # fmt: skip


def test_sizes_and_dtypes_take_vllm_s_spellings():
    def config(*flags: str) -> EngineConfig:
        return engine_config(build_parser().parse_args(["serve", *flags]))

    assert config("--dtype", "half").dtype == "float16"
    assert config("--dtype", "float").dtype == "float32"
    assert config("--max-model-len", "32k").max_model_len == 32000
    assert config("--max-model-len", "32K").max_model_len == 32768
    assert config("--max-model-len", "auto").max_model_len is None
    assert config("--max-model-len", "-1").max_model_len is None
    assert config("--max-num-batched-tokens", "2.5k").max_num_batched_tokens == 2500
    assert config("--kv-cache-memory-bytes", "2G").cache.kv_cache_memory == 2 * 1024**3
    assert config("--kv-cache-memory-bytes", "2g").cache.kv_cache_memory == 2 * 10**9
    assert config("--kv-cache-memory", "2GiB").cache.kv_cache_memory == 2 * 1024**3


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--dtype", "double"], "not a dtype"),
        (["--max-model-len", "1.5K"], "a K count is a whole number"),
        (["--max-num-batched-tokens", "2e3k"], "not a count"),
        (["--kv-cache-memory-bytes=-4g"], "not a count"),
    ],
)
def test_sizes_vllm_would_not_read_are_refused(capsys, flags, reason):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])
    assert reason in capsys.readouterr().err


def test_vllm_s_name_for_the_block_count_sets_it():
    config = engine_config(build_parser().parse_args(["serve", "--num-gpu-blocks-override", "99"]))
    assert config.cache.num_blocks == 99


def test_a_recipe_s_flags_with_nothing_to_set_change_nothing():
    plain = build_parser().parse_args(["serve", "--max-num-seqs", "8"])
    recipe = build_parser().parse_args(["serve", "--max-num-seqs", "8", *RECIPE])
    assert engine_config(recipe) == engine_config(plain)
    assert server_settings(recipe) == server_settings(plain)


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--pipeline-parallel-size", "2"], "pipeline parallelism is not built"),
        (["-pp", "2"], "pipeline parallelism is not built"),
        (["--distributed-executor-backend", "ray"], "'ray' is not served"),
        (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "'eagle'"),
        (["--speculative-config", '{"method": "ngram"}'], "needs num_speculative_tokens"),
        (["--swap-space", "-1"], "must be 0 or more"),
        (["--guided-decoding-backend", "regex"], "not a structured-output backend"),
        (["--structured-outputs-config", "[1]"], "not a JSON object"),
        (["--kv-events-config", '{"publisher": "nats"}'], "unknown KV events publisher"),
        (["--profiler-config", '{"profiler": "cuda", "torch_profiler_dir": "/t"}'], "'cuda'"),
        (["--profiler-config", '{"profiler": "torch"}'], "needs torch_profiler_dir"),
        (["-O4"], "optimization levels are 0-3"),
        (["--api-server-count", "4"], "scale out with replicas"),
        (["--preemption-mode", "swap"], "'swap' is not served"),
        (["--compilation-config", '{"cudagraph_mode": "ALL"}'], "'ALL' is not one of NONE"),
        (["--compilation-config", '{"graphs": 1}'], "unknown compilation config fields: graphs"),
        (["-cc", '{"cudagraph_capture_sizes": [0]}'], "list of positive integers"),
        (["--config-format", "mistral"], "'mistral' is not served: the model's config.json"),
        (["--safetensors-load-strategy", "eager"], "'eager' is not served: safetensors files"),
        (["--prefix-caching-hash-algo", "xxhash"], "'xxhash' is not served: prefix-cache"),
    ],
)
def test_what_a_recipe_asks_that_is_not_served_is_refused_by_name(capsys, flags, reason):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])
    assert reason in capsys.readouterr().err


def test_the_local_media_path_must_be_a_folder(tmp_path):
    settings = settings_of("--allowed-local-media-path", str(tmp_path))
    assert settings.limits.allowed_local_media_path == tmp_path
    assert settings_of().limits.allowed_local_media_path is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-local-media-path", str(tmp_path / "no")])


def test_an_n_gram_speculative_config_is_served():
    args = build_parser().parse_args(
        [
            "serve",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}',
        ]
    )
    assert engine_config(args).speculative == SpeculativeConfig(4, 3, 3)
    both = ["serve", "--async-scheduling", "--speculative-config", '{"num_speculative_tokens": 2}']
    with pytest.raises(ValueError, match="--async-scheduling"):
        engine_config(build_parser().parse_args(both))


def test_a_suffix_decoding_speculative_config_is_served():
    config = '{"method": "suffix", "suffix_decoding_max_cached_requests": 100}'
    args = build_parser().parse_args(["serve", "--speculative-config", config])
    spec = engine_config(args).speculative
    assert spec is not None and spec.method == "suffix"
    assert (spec.num_speculative_tokens, spec.suffix.max_cached_requests) == (24, 100)
    bad = '{"method": "suffix", "suffix_decoding_min_token_prob": 2}'
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", bad])


def test_a_draft_model_speculative_config_is_served():
    config = '{"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 5, "method": "draft_model"}'
    args = build_parser().parse_args(["serve", "--speculative-config", config])
    spec = engine_config(args).speculative
    assert spec == SpeculativeConfig(5, method="draft_model", model="Qwen/Qwen3-0.6B")
    sharded = ["serve", "-tp", "2", "--speculative-config", config]
    with pytest.raises(ValueError, match="one device"):
        engine_config(build_parser().parse_args(sharded))


def test_per_request_metrics_flags_reach_the_engine_and_the_server():
    args = build_parser().parse_args(
        ["serve", "--enable-per-request-metrics", "--per-request-spec-decode-metrics", "summary"]
    )
    assert engine_config(args).spec_metrics == "summary"
    assert server_settings(args).per_request_metrics
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--per-request-spec-decode-metrics", "all"])


def test_a_kv_events_config_is_served_with_prefix_caching_only():
    events = '{"enable_kv_cache_events": true, "topic": "kv@pod@model"}'
    config = engine_config(build_parser().parse_args(["serve", "--kv-events-config", events]))
    assert config.kv_events is not None and config.kv_events.publishes
    assert config.kv_events.topic == "kv@pod@model" and config.kv_events.endpoint == "tcp://*:5557"
    uncached = ["serve", "--no-enable-prefix-caching", "--kv-events-config", events]
    with pytest.raises(ValueError, match="needs prefix caching"):
        engine_config(build_parser().parse_args(uncached))
    # Events off (vLLM's default) publish nothing and need nothing.
    off = ["serve", "--no-enable-prefix-caching", "--kv-events-config", "{}"]
    assert not engine_config(build_parser().parse_args(off)).kv_events.publishes


def test_a_profiler_config_reaches_the_engine():
    traces = '{"profiler": "torch", "torch_profiler_dir": "/t", "max_iterations": 5}'
    config = engine_config(build_parser().parse_args(["serve", "--profiler-config", traces]))
    assert config.profiler is not None and config.profiler.enabled
    assert config.profiler.folder == "/t" and config.profiler.max_iterations == 5
    assert engine_config(build_parser().parse_args(["serve"])).profiler is None


def graphs_of(*flags: str) -> tuple[bool, tuple[int, ...], int | None, bool]:
    config = engine_config(build_parser().parse_args(["serve", *flags]))
    return (
        config.enforce_eager,
        config.cuda_graph_sizes,
        config.max_cuda_graph_size,
        config.mixed_step_graphs,
    )


def test_a_recipe_s_cuda_graph_flags_set_conveyor_s_graphs():
    assert graphs_of() == (False, (), None, True)
    assert graphs_of("-O0") == graphs_of("-O", "0") == (True, (), None, True)
    assert graphs_of("--compilation-config", '{"cudagraph_mode": "NONE"}')[0] is True
    assert graphs_of("-cc", '{"use_cudagraph": false}')[0] is True
    decode_only = '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}'
    assert graphs_of("--compilation-config", decode_only) == (False, (1, 2, 4), None, False)
    assert graphs_of("-cc", '{"max_cudagraph_capture_size": 64}') == (False, (), 64, True)
    assert graphs_of("--cuda-graph-sizes", "1", "8", "32") == (False, (1, 8, 32), None, True)
    # The compilation config's own sizes win over the older flag's.
    both = ["--cuda-graph-sizes", "1", "--compilation-config", '{"cudagraph_capture_sizes": [2]}']
    assert graphs_of(*both)[1] == (2,)
    run = build_parser().parse_args(["batch", "run", "in.jsonl", "out.jsonl", "-O0"])
    assert engine_config(run).enforce_eager


def test_a_logprobs_mode_is_served_but_processed_ones_not_beside_speculation():
    args = build_parser().parse_args(["serve", "--logprobs-mode", "processed_logits"])
    assert engine_config(args).logprobs_mode == "processed_logits"
    both = ["serve", "--logprobs-mode", "processed_logprobs"]
    both += ["--speculative-config", '{"num_speculative_tokens": 2}']
    with pytest.raises(ValueError, match="do not run together"):
        engine_config(build_parser().parse_args(both))
    raw = ["serve", "--logprobs-mode", "raw_logits", "--speculative-config"]
    assert engine_config(build_parser().parse_args([*raw, '{"num_speculative_tokens": 2}']))


def test_a_data_parallel_rank_serves_as_one_of_a_fleet():
    """vLLM's external load balancing: each rank is a server of its own behind a router."""
    args = build_parser().parse_args(
        ["serve", "-dp", "4", "--data-parallel-rank", "3", "--data-parallel-external-lb",
         "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345",
         "--data-parallel-size-local", "1"]
    )  # fmt: skip
    assert engine_config(args).data_parallel_rank == 3
    assert engine_config(build_parser().parse_args(["serve"])).data_parallel_rank == 0
    for argv, message in [
        (["-dp", "4"], "one server serves one replica"),
        (["-dp", "2", "-dpn", "2"], "is not below --data-parallel-size 2"),
        (["-dpn", "1"], "is not below --data-parallel-size 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine_config(build_parser().parse_args(["serve", *argv]))
    for argv in (["-dp", "0"], ["-dpn", "-1"], ["--data-parallel-size-local", "2"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *argv])
