"""Reading tool calls out of a model's free text (`tool_choice: "auto"`), in the format its chat
template teaches (`--tool-call-parser`, vLLM's names; `server/call_formats.py` reads each
format's calls). Calls stream as they are written (`server/call_stream.py`,
`server/call_elements.py`, `server/call_python.py`, `server/call_gemma.py`): each call once it
has begun in its format, then its arguments as they grow.

- Calls between tags, text around them content. The streaming reader (`server/call_readers.py`)
  holds back text that may be the start of a tag until it is known not to be. A block the reply
  leaves open is read as if it closed there.
  - `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen2.5, Qwen3 and
    ERNIE 4.5 (`ernie45`) write them (a block may also hold a list of such objects, as SmolLM2
    writes them).
  - `qwen3_coder`: the same tags around `<function=NAME>` with one `<parameter=KEY>` element per
    argument (Qwen3-Coder); `seed_oss`: the same inside `<seed:tool_call>` (Seed-OSS).
  - `glm45` and `glm47`: `<tool_call>NAME` then `<arg_key>` / `<arg_value>` pairs (GLM-4.5 and
    4.6 on lines of their own, GLM-4.7 without line breaks; either reads both).
  - `minimax_m2`: `<minimax:tool_call>` around `<invoke name=...>` elements of
    `<parameter name=...>` elements (MiniMax-M2).
  - `kimi_k2`: `<|tool_calls_section_begin|>` around `<|tool_call_begin|>functions.NAME:N
    <|tool_call_argument_begin|>{...}<|tool_call_end|>` calls (Kimi K2).
  - `deepseek_v3` and `deepseek_v31`: `<｜tool▁calls▁begin｜>` around DeepSeek-V3's calls (the
    arguments in a fenced JSON block) or V3.1's (`NAME<｜tool▁sep｜>{...}`); `deepseek_v32`:
    `<｜DSML｜function_calls>` around `<｜DSML｜invoke name=...>` elements of `<｜DSML｜parameter
    name=... string="true|false">` elements or a JSON object (DeepSeek-V3.2); `deepseek_v4`:
    the same in `<｜DSML｜tool_calls>` (DeepSeek-V4).
  - `hunyuan_a13b`, `jamba` and `minimax`: `<tool_calls>` around a JSON list of calls or one
    call object per line.
  - `internlm`: `<|action_start|><|plugin|>` ... `<|action_end|>` around one JSON call
    (InternLM 2.5); `longcat`: `<longcat_tool_call>` around one (LongCat-Flash).
  - `olmo3`: `<function_calls>` around one Python call per line (OLMo 3); `lfm2`:
    `<|tool_call_start|>` around a Python list of calls (LFM2).
  - `apertus`: `<|tools_prefix|>` around a JSON list of `{"NAME": {...arguments}}` objects
    (Apertus).
  - `step3`: `<｜tool_calls_begin｜>` around calls of `<steptml:invoke name=...>` elements,
    each after `<｜tool_call_begin｜>function<｜tool_sep｜>` (Step3).
  - `gemma4`: `<|tool_call>call:NAME{key:<|"|>text<|"|>}<tool_call|>`, Gemma 4's own syntax;
    `functiongemma`: the same between `<start_function_call>` and `<end_function_call>`, its
    strings between `<escape>` (`server/call_gemma.py`).
- Calls that are the whole reply, held from its first character until it ends, then read
  (any other reply is content, streamed as it comes):
  - `llama3_json`: one or more `{"name": ..., "parameters": {...}}` objects (after an optional
    `<|python_tag|>`, separated by `;`), as Llama 3.1-3.3 write them.
  - `pythonic`: a Python list of calls, `[get_weather(city="Oslo"), ...]` (inside an optional
    `<|python_start|>` ... `<|python_end|>`), as Llama 3.2 and Llama 4 write them.
  - `granite`: a JSON list of `{"name", "arguments"}` objects after `<|tool_call|>` (Granite
    3.0's special token) or `<tool_call>` (Granite 3.1's text); `phi4_mini_json`: the same
    list after `functools`; `xlam`: the list bare or in a fenced code block.
- `mistral`: text, then `[TOOL_CALLS]` and the calls to the end of the reply: a JSON list of
  `{"name", "arguments"}` objects (Mistral's v3 tokenizers) or `NAME[ARGS]{...}` per call.

A request whose parser's tags are special tokens of the tokenizer (Kimi's, DeepSeek's,
InternLM's, and any other where the model's tokenizer marks them so) keeps special tokens in
its text, which the tags must be in to be read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

from server import call_formats as formats
from server.call_array import assemble
from server.call_elements import (
    DSML_INVOKES,
    FUNCTION_ELEMENTS,
    INVOKES,
    STEP3_INVOKES,
    Elements,
    GlmCall,
)
from server.call_formats import (
    ARG_KEY,
    CLOSE,
    DEEPSEEK_CALL,
    DEEPSEEK_CALL_END,
    DEEPSEEK_SEP,
    DSML,
    FUNCTION,
    FUNCTOOLS,
    GRANITE_TOOL_CALL,
    KIMI_ARGUMENTS,
    KIMI_CALL,
    KIMI_CALL_END,
    OPEN,
    PARAMETER,
    PHI4_TOOLS,
    PYTHON_START,
    PYTHON_TAG,
    TOOL_CALLS,
    BlockReader,
    Calls,
    Schemas,
)
from server.call_gemma import FUNCTIONGEMMA_STRING, GEMMA4_STRING, GemmaCalls, gemma_reader
from server.call_python import PythonCalls
from server.call_readers import (
    CallReader,
    MistralReader,
    TaggedReader,
    WholeReplyReader,
)
from server.call_stream import BlockScanner, DelimitedCalls, HeldCalls, JsonCalls, MistralCalls


@dataclass(frozen=True, slots=True)
class Tagged:
    """Calls between `open` and `close`, read by `read`; `inner`: the format's other tags."""

    open: str
    close: str
    read: BlockReader
    inner: tuple[str, ...] = ()
    # Reads a block while it arrives, for its calls to stream (None: each call whole once
    # its block closes).
    scan: Callable[[Schemas | None], BlockScanner] | None = None


@dataclass(frozen=True, slots=True)
class WholeReply:
    """A reply that opens with one of `openers` is calls, read whole by `read`."""

    openers: tuple[str, ...]
    read: BlockReader
    # Reads the calls while they arrive, past whichever of `skip` opens them (None: the calls
    # come whole once the reply ends).
    scan: Callable[[], BlockScanner] | None = None
    skip: tuple[str, ...] = ()


def json_calls(_schemas: Schemas | None) -> JsonCalls:
    return JsonCalls()


def function_elements(schemas: Schemas | None) -> Elements:
    return Elements(FUNCTION_ELEMENTS, schemas)


def glm_call(schemas: Schemas | None) -> GlmCall:
    return GlmCall(schemas=schemas)


TOOL_CALLS_BLOCK = Tagged("<tool_calls>", "</tool_calls>", formats.json_lines, scan=json_calls)
# GLM-4.5 and 4.7 (which writes no line breaks between the pieces) read alike.
GLM = Tagged(OPEN, CLOSE, formats.glm, (ARG_KEY, "<arg_value>"), scan=glm_call)
DEEPSEEK = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_INNER = (DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END)
KIMI_TAGS = (KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END)
FORMATS: dict[str, Tagged | WholeReply] = {
    "hermes": Tagged(OPEN, CLOSE, formats.json_block, scan=json_calls),
    "qwen3_coder": Tagged(OPEN, CLOSE, formats.function_elements, scan=function_elements),
    "seed_oss": Tagged(
        "<seed:tool_call>", "</seed:tool_call>", formats.function_elements, scan=function_elements
    ),
    "glm45": GLM,
    "glm47": GLM,
    "minimax_m2": Tagged(
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        formats.invokes,
        scan=lambda schemas: Elements(INVOKES, schemas),
    ),
    "kimi_k2": Tagged(
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        formats.kimi,
        KIMI_TAGS,
        scan=lambda _schemas: DelimitedCalls(*KIMI_TAGS, formats.kimi_head),
    ),
    "deepseek_v3": Tagged(
        *DEEPSEEK,
        formats.deepseek_v3,
        DEEPSEEK_INNER,
        scan=lambda _schemas: DelimitedCalls(*DEEPSEEK_INNER, formats.plain_head, fenced=True),
    ),
    "deepseek_v31": Tagged(
        *DEEPSEEK,
        formats.deepseek_v31,
        DEEPSEEK_INNER,
        scan=lambda _schemas: DelimitedCalls(*DEEPSEEK_INNER, formats.plain_head),
    ),
    "deepseek_v32": Tagged(
        f"<{DSML}function_calls>",
        f"</{DSML}function_calls>",
        formats.dsml,
        (DSML,),
        scan=lambda schemas: Elements(DSML_INVOKES, schemas),
    ),
    # DeepSeek-V4 keeps V3.2's elements in a block of another name.
    "deepseek_v4": Tagged(
        f"<{DSML}tool_calls>",
        f"</{DSML}tool_calls>",
        formats.dsml,
        (DSML,),
        scan=lambda schemas: Elements(DSML_INVOKES, schemas),
    ),
    "step3": Tagged(
        "<｜tool_calls_begin｜>",
        "<｜tool_calls_end｜>",
        formats.step3,
        (formats.STEP3_CALL, formats.STEP3_SEP, formats.STEP3_CALL_END),
        scan=lambda schemas: Elements(STEP3_INVOKES, schemas),
    ),
    "hunyuan_a13b": TOOL_CALLS_BLOCK,
    "jamba": TOOL_CALLS_BLOCK,
    "minimax": TOOL_CALLS_BLOCK,
    "internlm": Tagged(
        "<|action_start|><|plugin|>", "<|action_end|>", formats.json_block, scan=json_calls
    ),
    "longcat": Tagged(
        "<longcat_tool_call>", "</longcat_tool_call>", formats.json_block, scan=json_calls
    ),
    "gemma4": Tagged(
        "<|tool_call>",
        "<tool_call|>",
        gemma_reader(GEMMA4_STRING),
        (GEMMA4_STRING,),
        scan=lambda _schemas: GemmaCalls(quote=GEMMA4_STRING),
    ),
    "functiongemma": Tagged(
        "<start_function_call>",
        "<end_function_call>",
        gemma_reader(FUNCTIONGEMMA_STRING),
        (FUNCTIONGEMMA_STRING,),
        scan=lambda _schemas: GemmaCalls(quote=FUNCTIONGEMMA_STRING),
    ),
    "lfm2": Tagged(
        "<|tool_call_start|>",
        "<|tool_call_end|>",
        formats.pythonic,
        scan=lambda _schemas: PythonCalls(),
    ),
    "apertus": Tagged(
        "<|tools_prefix|>",
        "<|tools_suffix|>",
        formats.keyed_list,
        scan=lambda _schemas: JsonCalls(keyed=True),
    ),
    "olmo3": Tagged(
        "<function_calls>",
        "</function_calls>",
        formats.pythonic_lines,
        scan=lambda _schemas: PythonCalls(listed=False, json_names=True),
    ),
    "llama3_json": WholeReply((PYTHON_TAG, "{"), formats.llama3, JsonCalls, (PYTHON_TAG,)),
    "pythonic": WholeReply((PYTHON_START, "["), formats.pythonic, PythonCalls, (PYTHON_START,)),
    "granite": WholeReply(
        (GRANITE_TOOL_CALL, OPEN, "["), formats.granite, JsonCalls, (GRANITE_TOOL_CALL, OPEN)
    ),
    "phi4_mini_json": WholeReply((FUNCTOOLS + "[",), formats.functools, JsonCalls, (FUNCTOOLS,)),
    "xlam": WholeReply(("[", "```"), formats.xlam, JsonCalls, ("```json", "```")),
}
# `openai` reads gpt-oss's Harmony messages to functions (`server/harmony.py`); `mistral` has a
# reader of its own.
# vLLM's other names for formats read here.
ALIASES = {
    "llama4_json": "llama3_json",
    "llama4_pythonic": "pythonic",
    "qwen3_xml": "qwen3_coder",
    "ernie45": "hermes",
    "granite4": "hermes",
    "mimo": "qwen3_coder",
}
PARSERS = tuple(sorted({*FORMATS, "mistral", "openai", *ALIASES}))
# Parsers whose tags are special tokens in every tokenizer that writes them.
KEEPS_SPECIAL_TOKENS = frozenset({"mistral", "openai"})
# Tags a chat template writes, and the parser of the format they open, most specific first.
TEMPLATE_TAGS = (
    (GRANITE_TOOL_CALL, "granite"),
    (FUNCTOOLS, "phi4_mini_json"),
    (PHI4_TOOLS, "phi4_mini_json"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    (f"<{DSML}tool_calls>", "deepseek_v4"),
    (DSML, "deepseek_v32"),
    (DEEPSEEK_CALL, "deepseek"),
    ("<minimax:tool_call>", "minimax_m2"),
    ("<seed:tool_call>", "seed_oss"),
    ("<longcat_tool_call>", "longcat"),
    ("<|plugin|>", "internlm"),
    ("<|tool_call>", "gemma4"),
    ("<start_function_call>", "functiongemma"),
    ("<|tool_call_start|>", "lfm2"),
    ("<steptml:invoke", "step3"),
    ("<|tools_prefix|>", "apertus"),
    ("<function_calls>", "olmo3"),
    ("<tool_calls>", "hunyuan_a13b"),
    (ARG_KEY, "glm45"),
)


def parser_for(name: str | None, chat_template: str | None) -> str | None:
    """The parser `--tool-call-parser` names, else the one the chat template's own tags show,
    else None (calls are not read from free text)."""
    if name is not None:
        return ALIASES.get(name, name)
    template = chat_template or ""
    for tag, parser in TEMPLATE_TAGS:
        if tag in template:
            if parser == "deepseek":  # V3 writes the arguments in a fenced block, V3.1 bare
                return "deepseek_v3" if "```json" in template else "deepseek_v31"
            if parser == "glm45" and "</arg_key><arg_value>" in template:
                return "glm47"  # GLM-4.7 writes no line breaks between the pieces
            return parser
    if OPEN in template and FUNCTION in template and PARAMETER in template:
        return "qwen3_coder"
    if OPEN in template:
        return "hermes"
    if TOOL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template:
        return "llama3_json"
    return None


def reader_for(parser: str, schemas: Schemas | None = None) -> CallReader:
    """A streaming reader of `parser`'s calls; `schemas` type the values of formats that write
    them as text."""
    if parser == "mistral":
        return MistralReader(HeldCalls(MistralCalls))
    form = FORMATS.get(ALIASES.get(parser, parser), FORMATS["hermes"])
    read = partial(form.read, schemas=schemas)
    if isinstance(form, WholeReply):
        return WholeReplyReader(form.openers, read, HeldCalls(form.scan, form.skip))
    scanner = None if form.scan is None else partial(form.scan, schemas)
    return TaggedReader(form.open, form.close, read, scanner)


def keeps_special_tokens(parser: str | None, tokenizer: Any) -> bool:
    """Whether a reply read by `parser` must keep special tokens in its text: its tags are
    special tokens of `tokenizer`, or always are."""
    if parser in KEEPS_SPECIAL_TOKENS:
        return True
    form = FORMATS.get(ALIASES.get(parser or "", parser or ""))
    if not isinstance(form, Tagged):
        return False
    special = special_texts(tokenizer)
    return any(tag in special for tag in (form.open, form.close, *form.inner))


@lru_cache(maxsize=8)
def special_texts(tokenizer: Any) -> frozenset[str]:
    """The texts of the tokenizer's added tokens marked special (which decoding with
    `skip_special_tokens` drops), read once per tokenizer."""
    return frozenset(
        token.content
        for token in getattr(tokenizer, "added_tokens_decoder", {}).values()
        if getattr(token, "special", False)
    )


def parse_calls(parser: str, text: str, schemas: Schemas | None = None) -> tuple[str | None, Calls]:
    """The text outside the calls (None if only blanks) and the calls, from a whole output."""
    reader = reader_for(parser, schemas)
    content, entries = reader.feed(text)
    rest, more = reader.finish()
    content += rest
    return (content if content.strip() else None), assemble(entries + more)
