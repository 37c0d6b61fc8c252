"""Tool calls (``serve.tools``): the Hermes (Qwen2.5/3) and Llama 3.1 JSON formats parse to
OpenAI's ``tool_calls`` however the text is cut (streamed = not streamed), the chat template
receives ``tools``, assistant ``tool_calls`` and ``role: "tool"`` messages, ``tool_choice``
``"required"`` and a named function always give calls whose arguments validate, even from an
untrained model, through the server and the real openai client, streamed as not (the tokenizer
holds Qwen's ``<tool_call>`` and ``<think>`` as added tokens; a template with no tool-call
format gets vLLM's JSON calls), and every bad tool field is a 400 naming it."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil

import jsonschema
import pytest
from helpers import CHATML, QWEN_ADDED, TINY, Served, random_params, write_byte_tokenizer

from transformer_jax.serve import completions, tools
from transformer_jax.serve.protocol import APIError, ChatCompletionRequest
from transformer_jax.serving import Engine, SamplingParams, TokenEvent
from transformer_jax.serving.grammar import GrammarTokenizer
from transformer_jax.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")

CONFIG = TINY.replace(vocab_size=320, max_seq_len=1024)

# A Qwen-style (Hermes) template: the tools as JSON lines in the system turn, calls in
# <tool_call> blocks, tool results in <tool_response> blocks of a user turn.
HERMES = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'Functions you can call, one signature a line:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools>\\nTo call one, write <tool_call>\\n{\"name\": <name>, \"arguments\": "
    "<object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' "
    "+ (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A Llama 3.1-style template: the tools in the system turn, a call as bare JSON with
# "parameters", tool results in an ipython turn.
LLAMA = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\nTo call a "
    "function, reply {\"name\": function name, \"parameters\": its arguments}, after "
    "<|python_tag|> if you like.\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message.tool_calls %}"
    "{{- '{\"name\": \"' + call.function.name + '\", \"parameters\": ' "
    "+ (call.function.arguments | tojson) + '}' }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content "
    "+ '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
FIND = {"type": "object", "additionalProperties": False, "required": ["q"],
        "properties": {"q": {"type": "string", "maxLength": 6},
                       "exact": {"type": "boolean"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "find", "parameters": FIND}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: no arguments
]
SCHEMAS = {"get_weather": WEATHER, "find": FIND, "ping": tools.NO_PARAMETERS}
USER = [{"role": "user", "content": "hello"}]


# Parsing --------------------------------------------------------------------------------------

def _call(name: str, arguments: dict) -> tuple[str, dict]:
    return name, arguments


HERMES_CASES = [  # (reply text, content, calls as (name, arguments))
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
     "</tool_call>", "", [_call("get_weather", {"city": "Oslo", "days": 2})]),
    ('Let me look.\n<tool_call>\n{"name": "find", "arguments": {"q": "é<x>"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n',
     "Let me look.", [_call("find", {"q": "é<x>"}), _call("ping", {})]),
    ('a <tool_call>{"name": "ping", "arguments": {}</tool_call> b',  # malformed: text
     'a <tool_call>{"name": "ping", "arguments": {}</tool_call> b', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("no call, only <tool_ and <tool_call", "no call, only <tool_ and <tool_call", []),
    ('<tool_call>\n{"name": "ping", "arguments": {}}', "", [_call("ping", {})]),  # unclosed
    ("plain text\n\n", "plain text\n\n", []),
]
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Lima", "days": 7}}', "",
     [_call("get_weather", {"city": "Lima", "days": 7})]),
    ('<|python_tag|>{"name": "find", "parameters": {"q": "a;b"}}; {"name": "ping", '
     '"parameters": {}}', "", [_call("find", {"q": "a;b"}), _call("ping", {})]),
    (' {"name": "ping", "parameters": {}} ; then text', "then text", [_call("ping", {})]),
    ('{"name": "ping", "parameters": {', '{"name": "ping", "parameters": {', []),  # malformed
    ('{"city": "Oslo"}', '{"city": "Oslo"}', []),  # JSON, but no call
    ("The answer is {42}.", "The answer is {42}.", []),
]
# Enforced calls on a template with no format: a JSON list of calls, or the named function's
# arguments ("json:find").
JSON_CASES = [
    ('[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]', "",
     [_call("get_weather", {"city": "Oslo", "days": 2})]),
    ('[{"name": "find", "arguments": {"q": "a,]"}}, {"name": "ping", "arguments": {}}]', "",
     [_call("find", {"q": "a,]"}), _call("ping", {})]),
    ('[{"name": "find", "arguments": {"q": "a"}}, {"name": "pi',  # cut by max_tokens
     '{"name": "pi', [_call("find", {"q": "a"})]),
    ('{"name": "ping", "arguments": {}}', '{"name": "ping", "arguments": {}}', []),  # no list
    ("[1, 2]", "[1, 2]", []),
]
NAMED_CASES = [
    ('{"q": "x", "exact": true}', "", [_call("find", {"q": "x", "exact": True})]),
    ('{"q": "x"', '{"q": "x"', []),  # cut
    ("[1]", "[1]", []),
]


def _cuts(text: str, seed: int) -> list[list[str]]:
    """``text`` cut every way a stream might: whole, one character at a time, and at random."""
    rng = random.Random(seed)
    ways = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return ways


@pytest.mark.parametrize("kind, cases", [("hermes", HERMES_CASES), ("llama3_json", LLAMA_CASES),
                                         ("json", JSON_CASES), ("json:find", NAMED_CASES)])
def test_replies_parse_to_content_and_calls_however_the_stream_cuts_them(kind, cases):
    for i, (text, content, calls) in enumerate(cases):
        got_content, got_calls = tools.parse_reply(text, kind)
        assert got_content == content, text
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, text
        for pieces in _cuts(text, i):
            parser = tools.make_parser(kind)
            out = [p for piece in pieces for p in parser.feed(piece)] + parser.finish()
            assert "".join(p for p in out if isinstance(p, str)) == content, pieces
            assert [(c.name, json.loads(c.arguments)) for c in out
                    if isinstance(c, tools.ToolCall)] == calls, pieces


def test_text_that_may_start_a_call_is_held_back_and_the_rest_streams_at_once():
    parser = tools.make_parser("hermes")
    assert parser.feed("Hi there <tool") == ["Hi there"]  # " <tool" may begin a call
    assert parser.feed("box> x") == [" <toolbox> x"]
    assert parser.feed(' <tool_call>{"name": "ping", "arguments": {}}') == []
    (call,) = parser.feed("</tool_call>")
    assert (call.name, call.arguments, call.id[:5]) == ("ping", "{}", "call_")
    llama = tools.make_parser("llama3_json")
    assert llama.feed("  <|pyth") == []
    assert llama.feed("on_tag|>") == []
    assert llama.feed('{"name": "ping", "parameters": {}}')[0].name == "ping"
    assert tools.make_parser("llama3_json").feed("Sure: {") == ["Sure: {"]


def test_the_parser_follows_the_chat_template():
    assert tools.parser_for_template(HERMES) == "hermes"
    assert tools.parser_for_template(LLAMA) == "llama3_json"
    assert tools.parser_for_template(CHATML) is None
    with pytest.raises(ValueError, match="tool-call parser must be one of"):
        tools.make_parser("mistral")


# The prompt ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hermes_info(tmp_path_factory):
    tok = load_tokenizer(write_byte_tokenizer(tmp_path_factory.mktemp("hermes"),
                                              chat_template=HERMES))
    return completions.ModelInfo.of("tiny", CONFIG, tok)


def _chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": USER, **body})


def test_the_template_gets_tools_assistant_calls_and_tool_messages(hermes_info):
    history = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "wind"},
    ]
    req = ChatCompletionRequest.model_validate({"model": "tiny", "messages": history,
                                                "tools": TOOLS})
    prepared = completions.prepare(req, hermes_info)
    text = hermes_info.tokenizer.decode(prepared.prompt)
    for tool in TOOLS:  # each tool as the template's tojson writes it, in OpenAI's format
        assert json.dumps(tool, ensure_ascii=False) + "\n" in text
    assert ('<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "days": 1}}\n</tool_call><|im_end|>') in text  # a dict, not text
    assert ("<|im_start|>user\n<tool_response>\nrain, 4 C\n</tool_response>\n<tool_response>"
            "\nwind\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert prepared.tool_parser == "hermes" and prepared.params.grammar is None  # "auto"
    bare = completions.prepare(_chat(), hermes_info)
    assert "get_weather" not in hermes_info.tokenizer.decode(bare.prompt)
    assert bare.tool_parser is None
    none = completions.prepare(_chat(tools=TOOLS, tool_choice="none"), hermes_info)
    assert none.prompt == completions.prepare(_chat(tools=TOOLS), hermes_info).prompt
    assert none.tool_parser is None  # rendered, not parsed (as vLLM)


def test_a_template_without_a_known_format_is_refused_only_for_tool_choice_auto():
    req = _chat(tools=TOOLS)
    with pytest.raises(APIError) as bad:
        tools.reply_parser(req, CHATML)
    assert (bad.value.status, bad.value.param) == (400, "tools")
    assert tools.reply_parser(req, CHATML, "llama3_json") == "llama3_json"  # the server's
    assert tools.reply_parser(_chat(tools=TOOLS, tool_choice="none"), CHATML) is None
    # Enforced calls need no format (as vLLM): JSON, the grammar's whole reply.
    assert tools.reply_parser(_chat(tools=TOOLS, tool_choice="required"), CHATML) == "json"
    named = {"type": "function", "function": {"name": "find"}}
    assert tools.reply_parser(_chat(tools=TOOLS, tool_choice=named), CHATML) == "json:find"
    assert tools.reply_parser(_chat(tools=TOOLS, tool_choice=named), HERMES) == "hermes"


def test_a_hermes_grammar_takes_the_tags_as_their_added_tokens_or_as_text(tmp_path):
    """Qwen writes ``<tool_call>`` as one added token: the enforced grammar takes it so, or
    spelled out; either way the call parses."""
    from transformer_jax.serving.grammar import added_token_ids

    tok = load_tokenizer(write_byte_tokenizer(tmp_path, chat_template=HERMES, added=QWEN_ADDED))
    open_id, close_id = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    assert tok.encode("<tool_call>") == [open_id] and open_id >= 300  # an added token
    grammar = tools.tool_grammar(_chat(tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False), "hermes",
                                 added_token_ids(tok))
    grammars = GrammarTokenizer(tok, CONFIG.vocab_size)
    body = tok.encode('\n{"name": "ping", "arguments": {}}\n')
    spelled = [tok.encode("<") + tok.encode(tag[1:]) for tag in ("<tool_call>", "</tool_call>")]
    assert open_id not in spelled[0] and close_id not in spelled[1]
    for head, tail in (([open_id], [close_id]), spelled):
        matcher = grammars.matcher(grammar)
        ids = head + body + tail
        accepted = [matcher.consume_token(t) for t in ids]
        assert all(accepted) and matcher.is_stopped(), (tok.decode(ids), accepted)
        _, calls = tools.parse_reply(tok.decode(ids), "hermes")
        assert [(c.name, c.arguments) for c in calls] == [("ping", "{}")]


def _events(pieces: list[str], finish: str) -> list[list[TokenEvent]]:
    """One engine step per piece, its text on one token."""
    return [[TokenEvent(0, 7, i, text=p, finish_reason=finish if i == len(pieces) - 1 else None)]
            for i, p in enumerate(pieces)]


def _joined(chunks: list[dict]) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """A chat stream's content, calls (id, name, arguments) and finish reason, joined; checks
    that each call's id and name come in its first delta, and only there."""
    content, calls, finish = None, {}, None
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        if delta.get("content") is not None:
            content = (content or "") + delta["content"]
        for d in delta.get("tool_calls", ()):
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["type"] == "function", d
                calls[d["index"]] = [d["id"], d["function"]["name"], d["function"]["arguments"]]
            else:
                assert "id" not in d and "name" not in d["function"], d
                calls[d["index"]][2] += d["function"]["arguments"]
        finish = choice.get("finish_reason") or finish
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("text", [HERMES_CASES[1][0], HERMES_CASES[2][0], "just words"])
def test_streamed_chunks_joined_equal_the_whole_reply(hermes_info, text):
    prepared = completions.Prepared([1, 2], SamplingParams(max_tokens=8), True,
                                    tool_parser="hermes")
    for pieces in _cuts(text, 3)[:6]:
        stream, whole = (completions.Response(prepared, hermes_info) for _ in range(2))
        chunks = []
        for i, events in enumerate(_events(pieces, "stop")):
            got, tokens = stream.add(events)
            chunks += stream.chunks(got, tokens, stream.finish_reason, first=i == 0)
            whole.add(events)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        content, calls, finish = _joined(chunks)
        message = whole.choice()["message"]
        assert (content or None) == (message["content"] or None)
        assert [c[1:] for c in calls] == [(c["function"]["name"], c["function"]["arguments"])
                                          for c in message.get("tool_calls", ())]
        assert finish == whole.choice()["finish_reason"] == ("tool_calls" if calls else "stop")
    _, want_calls = tools.parse_reply(text, "hermes")
    assert [(c[1], c[2]) for c in calls] == [(c.name, c.arguments) for c in want_calls]


# Through the server, with the real openai client -----------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformer_jax import hf
    from transformer_jax.cli import serve as cli
    from transformer_jax.serve.app import create_app

    path = tmp_path_factory.mktemp("ckpt") / "tiny-tools"
    # Drawn with numpy (``helpers.random_params``): no init program compiles.
    hf.save(CONFIG, random_params(CONFIG, 5), path)
    # Qwen's tokenizer: <tool_call>, </tool_call>, <think> and </think> are added tokens.
    write_byte_tokenizer(path, chat_template=HERMES, added=QWEN_ADDED)
    args = cli.build_parser().parse_args(["--checkpoint", str(path), "--slots", "4",
                                          "--page-size", "16", "--token-budget", "48",
                                          "--compilation-cache", ""])
    # Without ``Engine.compile``'s 16 step shapes: the requests here run none of them (their
    # steps run the forward and sampling programs, compiled on first use); test_serve's
    # server covers build's compile.
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Engine, "compile", lambda self, *a, **k: 0)
        runner, info, _ = cli.build(args)
    runner.start()
    runner.ready = True
    # The same engine behind a Llama 3.1-style template (the tokenizer's ids are the same).
    llama_dir = tmp_path_factory.mktemp("llama")
    shutil.copy(path / "tokenizer.json", llama_dir / "tokenizer.json")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (llama_dir / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                 "chat_template": LLAMA}))
    llama_info = dataclasses.replace(info, tokenizer=load_tokenizer(llama_dir), turn_end=None)
    served, llama = Served(create_app(runner, info)), Served(create_app(runner, llama_info))
    # And behind a Qwen3-style thinking template, with ``--reasoning-parser qwen3``.
    think_dir = tmp_path_factory.mktemp("think")
    shutil.copy(path / "tokenizer.json", think_dir / "tokenizer.json")
    (think_dir / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                 "chat_template": THINKING}))
    think_info = dataclasses.replace(info, tokenizer=load_tokenizer(think_dir),
                                     reasoning_parser="qwen3")
    SERVED["think"] = Served(create_app(runner, think_info))
    # And behind a template that writes no tool-call format (ChatML without tools).
    plain_dir = tmp_path_factory.mktemp("plain")
    shutil.copy(path / "tokenizer.json", plain_dir / "tokenizer.json")
    (plain_dir / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                 "chat_template": CHATML}))
    SERVED["plain"] = Served(create_app(runner, dataclasses.replace(
        info, tokenizer=load_tokenizer(plain_dir))))
    yield served, llama, runner
    served.close()
    llama.close()
    SERVED.pop("think").close()
    SERVED.pop("plain").close()
    runner.stop()


SERVED: dict = {}

# Qwen3's way: the generation prompt opens the thinking block, or with enable_thinking false
# writes an empty one.
THINKING = HERMES.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}")


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _valid_calls(calls: list, names: set[str]) -> list:
    """``calls``, each checked: a function call with an id, a name among ``names``, arguments
    that validate against the tool's schema."""
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def _check_calls(reply, names: set[str], cut: bool = False) -> list:
    """The reply's one choice's calls, checked: finish reason, ids, names among ``names``,
    arguments that validate against the tool's schema; no content. With ``cut``, the reply
    may also have been cut at the token limit while writing a further call (then that call's
    text is the content)."""
    (choice,) = reply.choices
    calls = choice.message.tool_calls
    assert calls, choice
    if not (cut and choice.finish_reason == "length"):
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
    else:
        assert choice.message.content.startswith("<tool_call>"), choice
    assert len({c.id for c in calls}) == len(calls)
    return _valid_calls(calls, names)


def test_required_and_named_tool_choice_always_give_valid_calls(server):
    served, llama, runner = server
    for url, seeds in ((served.url, (0, 1, 2)), (llama.url, (3,))):
        client = _client(url)
        for seed in seeds:
            calls = _check_calls(client.chat.completions.create(
                model="tiny-tools", messages=USER, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, seed=seed, temperature=1.0,
                max_completion_tokens=200), set(SCHEMAS))
            assert len(calls) == 1
            calls = _check_calls(client.chat.completions.create(
                model="tiny-tools", messages=USER, tools=TOOLS, seed=seed, temperature=1.0,
                tool_choice={"type": "function", "function": {"name": "find"}},
                max_completion_tokens=200), {"find"})
            assert len(calls) == 1
    # Parallel calls (OpenAI's default): an untrained model may go on calling until the token
    # limit; every call it finished parses and validates.
    reply = _client(served.url).chat.completions.create(
        model="tiny-tools", messages=USER, tools=TOOLS, tool_choice="required", seed=1,
        temperature=1.0, max_completion_tokens=200)
    assert len(_check_calls(reply, set(SCHEMAS), cut=True)) >= 2  # this seed: several
    runner.engine.check_no_leaks()


def test_a_streamed_required_call_joined_equals_the_non_streamed_one(server):
    served, _, _ = server
    client = _client(served.url)
    ask = dict(model="tiny-tools", messages=USER, tools=TOOLS, tool_choice="required",
               seed=10, temperature=1.0, max_completion_tokens=200)
    whole = client.chat.completions.create(**ask)
    calls = _check_calls(whole, set(SCHEMAS))
    assert len(calls) >= 2  # this seed: several, then the end
    chunks = [c.model_dump(exclude_none=True)
              for c in client.chat.completions.create(**ask, stream=True)]
    content, streamed, finish = _joined(chunks)
    assert content is None and finish == "tool_calls"
    assert [c[1:] for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]


def test_enforced_calls_with_added_token_tags_in_every_variant(server):
    """The tokenizer holds ``<tool_call>`` as an added token (Qwen's): ``n`` choices, greedy,
    streamed and not, named and required, all give calls (none ends with the tag as text)."""
    served, _, runner = server
    client = _client(served.url)
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask = dict(model="tiny-tools", messages=USER, tools=TOOLS, max_completion_tokens=200)
    reply = client.chat.completions.create(**ask, tool_choice="required", n=3, seed=2,
                                           temperature=1.0, parallel_tool_calls=False)
    assert len(reply.choices) == 3
    for choice in reply.choices:
        calls = _check_calls(type(reply)(**{**reply.model_dump(), "choices": [
            choice.model_dump()]}), set(SCHEMAS))
        assert len(calls) == 1
    greedy = dict(ask, tool_choice=named, temperature=0.0)
    whole = client.chat.completions.create(**greedy)
    (call,) = _check_calls(whole, {"get_weather"})
    chunks = [c.model_dump(exclude_none=True)
              for c in client.chat.completions.create(**greedy, stream=True)]
    content, streamed, finish = _joined(chunks)
    assert (content, finish) == (None, "tool_calls")
    assert [c[1:] for c in streamed] == [(call.function.name, call.function.arguments)]
    runner.engine.check_no_leaks()


def test_grammar_text_that_spells_an_added_token_is_written(server):
    """``guided_choice`` / ``guided_regex`` whose text spells ``<think>`` or ``<tool_call>``
    (added tokens): the reply is that text, finish reason ``stop``, streamed as not."""
    import httpx

    served, _, runner = server
    with httpx.Client(base_url=served.url, timeout=60) as http:
        for guided, check in (({"guided_choice": ["<think>"]}, lambda t: t == "<think>"),
                              ({"guided_regex": "<tool_call>\n[a-z]{2,4}</think>"},
                               lambda t: re.fullmatch("<tool_call>\n[a-z]{2,4}</think>", t))):
            body = {"model": "tiny-tools", "prompt": "hello", "max_tokens": 40, "seed": 3,
                    **guided}
            whole = http.post("/v1/completions", json=body).json()
            (choice,) = whole["choices"]
            assert choice["finish_reason"] == "stop" and check(choice["text"]), whole
            lines = [line[6:] for line in http.post(
                "/v1/completions", json={**body, "stream": True}).text.splitlines()
                if line.startswith("data: {")]
            chunks = [json.loads(line)["choices"] for line in lines]
            assert "".join(c[0]["text"] for c in chunks if c) == choice["text"]
    runner.engine.check_no_leaks()


def _check_json_calls(reply, names: set[str]) -> list:
    """The calls of a reply enforced as JSON (no template format): as ``_check_calls``, and
    a reply cut at the token limit keeps the calls it finished (the rest is the content)."""
    (choice,) = reply.choices
    calls = choice.message.tool_calls
    assert calls, choice
    assert choice.finish_reason == "tool_calls" or choice.finish_reason == "length", choice
    if choice.finish_reason == "tool_calls":
        assert choice.message.content is None, choice
    return _valid_calls(calls, names)


def test_enforced_calls_on_a_template_without_a_tool_call_format(server):
    """A chat template that writes no format (ChatML): ``"required"`` is enforced as a JSON
    list of calls, a named function as its arguments (vLLM's way), streamed as not;
    ``"auto"`` is still a 400 naming ``tools``."""
    client = _client(SERVED["plain"].url)
    ask = dict(model="tiny-tools", messages=USER, tools=TOOLS, temperature=1.0,
               max_completion_tokens=200)
    for seed in (0, 1):
        calls = _check_json_calls(client.chat.completions.create(
            **ask, tool_choice="required", parallel_tool_calls=False, seed=seed), set(SCHEMAS))
        assert len(calls) == 1
        named = {"type": "function", "function": {"name": "find"}}
        calls = _check_json_calls(client.chat.completions.create(
            **ask, tool_choice=named, seed=seed), {"find"})
        assert len(calls) == 1
    whole = client.chat.completions.create(**ask, tool_choice="required", seed=5)
    calls = _check_json_calls(whole, set(SCHEMAS))
    chunks = [c.model_dump(exclude_none=True)
              for c in client.chat.completions.create(**ask, tool_choice="required", seed=5,
                                                      stream=True)]
    content, streamed, finish = _joined(chunks)
    assert finish == whole.choices[0].finish_reason
    assert (content or None) == (whole.choices[0].message.content or None)
    assert [c[1:] for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    import openai

    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(**ask)  # "auto"
    assert bad.value.body["param"] == "tools"
    server[2].engine.check_no_leaks()


def test_tool_choice_none_leaves_a_call_shaped_reply_as_text(server):
    served, _, _ = server
    shaped = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    reply = _client(served.url).chat.completions.create(
        model="tiny-tools", messages=USER, tools=TOOLS, tool_choice="none",
        max_completion_tokens=60, extra_body={"guided_choice": [shaped]})
    (choice,) = reply.choices
    assert (choice.message.content, choice.message.tool_calls) == (shaped, None)
    assert choice.finish_reason == "stop"


BAD = [  # (fields of the request, the param the 400 names)
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools.0.function.name"),
    ({"tools": [TOOLS[2], TOOLS[2]]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools.0.function.parameters"),
    ({"tools": [TOOLS[2], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]},
     "tools.1.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                "function": {"name": "f"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [*USER, {"role": "tool", "content": "4 C"}]}, "messages.1.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages.0.tool_calls"),
]


def test_every_bad_tool_field_is_a_400_naming_it(server):
    import httpx

    served, _, runner = server
    with httpx.Client(base_url=served.url) as http:
        for fields, param in BAD:
            r = http.post("/v1/chat/completions",
                          json={"model": "tiny-tools", "messages": USER, **fields})
            assert r.status_code == 400, (fields, r.text)
            error = r.json()["error"]
            assert (error["param"], error["type"]) == (param, "invalid_request_error"), \
                (fields, error)
    runner.engine.check_no_leaks()


def test_thinking_goes_to_reasoning_content_streamed_as_not(server):
    """With ``--reasoning-parser qwen3`` the reply's text before ``</think>`` is the message's
    ``reasoning_content`` (the template opened the block), the rest its content, in the stream
    as ``reasoning_content`` deltas first; ``chat_template_kwargs`` reach the template, and
    with thinking off the whole reply is content."""
    assert THINKING != HERMES
    client = _client(SERVED["think"].url)
    ask = dict(model="tiny-tools", messages=USER, temperature=0.0, max_tokens=40)
    forced = {"guided_regex": "[a-z]{3,6} ?[a-z]{2,4}</think>\n\n[a-z]{2,5}"}
    reply = client.chat.completions.create(**ask, extra_body=forced).choices[0]
    thought, answer = reply.message.reasoning_content, reply.message.content
    assert reply.finish_reason == "stop" and "</think>" not in thought + answer
    assert thought.replace(" ", "").isalpha() and answer.isalpha(), (thought, answer)
    chunks = list(client.chat.completions.create(**ask, extra_body=forced, stream=True))
    streamed = [c.choices[0].delta for c in chunks if c.choices]
    joined = ["".join(getattr(d, field, None) or "" for d in streamed)
              for field in ("reasoning_content", "content")]
    assert joined == [thought, answer]
    first = [i for i, d in enumerate(streamed) if getattr(d, "reasoning_content", None)]
    later = [i for i, d in enumerate(streamed) if d.content]
    assert max(first) < min(later)  # the reasoning streams before the answer
    off = client.chat.completions.create(**ask, extra_body={
        "guided_regex": "[a-z]{2,5}", "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.reasoning_content is None
    assert off.choices[0].message.content.isalpha()
    import httpx

    r = httpx.post(SERVED["think"].url + "/v1/chat/completions", json={
        **ask, "chat_template_kwargs": {"tools": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    server[2].engine.check_no_leaks()
