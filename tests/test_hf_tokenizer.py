"""tokenizer.json / SentencePiece checkpoints and chat templates, checked against transformers.

Every tokenizer is made in the test: a small byte-level BPE trained with the ``tokenizers``
library (ChatML special tokens, a Qwen2-style config) and a tiny SentencePiece model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from transformer_jax.tokenizer import (
    ChatTemplate,
    ChatTemplateError,
    HFTokenizer,
    TextTokenizer,
    Tokenizer,
    load_tokenizer,
    render_chat,
)

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# Qwen2's pre-tokenizer regex, so that transformers' Qwen2Tokenizer class builds the same pipeline.
QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

MIXED_TEXTS = [
    "def f(x):\n\treturn  x ** 2  # naïve café 日本語 🙂\r\n",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more  <|im_end|>x",
    "    indented {\n        'k': [1, 2, 3],\n    }\n",
    "e\u0301 ﬁ Ω 中文 \u00a0 tabs\t\tend",
    "",
    " ",
]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi there!"}],
    "system": [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    "multi": [
        {"role": "user", "content": "Write code: def f(x): return x"},
        {"role": "assistant", "content": "def f(x):\n    return x  # naïve 🙂"},
        {"role": "user", "content": "Thanks, café?"},
    ],
    "multi_system": [
        {"role": "system", "content": "You speak 日本語."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", "extra": None},
    ],
}


def training_lines(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["def", "return", "naïve", "café", "日本語", "🙂", "hello", "world", "x", "=", "(", ")"]
    lines = []
    for i in range(n):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(2, 10)))
        if i % 7 == 0:
            line = "    " + line + ":\n\tpass"
        lines.append(line)
    return lines


def build_bpe(directory: Path, config: dict, bos: str | None = None) -> Path:
    """A byte-level BPE tokenizer.json with ChatML specials plus a tokenizer_config.json."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + ([bos] if bos else [])
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_lines(), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML,
    }
    return build_bpe(tmp_path_factory.mktemp("qwen"), config)


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> Path:
    """Llama-3 style: no add_bos_token in the config; the post-processor adds bos."""
    from tokenizers import processors

    directory = tmp_path_factory.mktemp("llama3")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|eot_id|>", "special": True, "__type": "AddedToken"},
        "chat_template": LLAMA3,
    }
    build_bpe(directory, config, bos="<|begin_of_text|>")
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    # Header tokens named nowhere but in the template text: added specials like Llama 3's.
    tok.add_special_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    bos_id = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos_id)],
    )
    tok.save(str(directory / "tokenizer.json"))
    return directory


def auto(directory: Path):
    return transformers.AutoTokenizer.from_pretrained(str(directory))


# ------------------------------------------------------------------------- tokenizer.json


@pytest.mark.parametrize("name", ["qwen_dir", "llama3_dir"])
def test_encode_decode_match_transformers(request, name):
    directory = request.getfixturevalue(name)
    ours = load_tokenizer(directory)
    theirs = auto(directory)
    assert isinstance(ours, HFTokenizer) and isinstance(ours, TextTokenizer)
    assert ours.vocab_size == len(theirs)
    assert ours.bos_id == (-1 if theirs.bos_token_id is None else theirs.bos_token_id)
    assert ours.eos_id == theirs.eos_token_id
    for text in MIXED_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        with_specials = ours.encode(text, add_bos=ours.add_bos_token, add_eos=ours.add_eos_token)
        assert with_specials == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids) == text.replace("e\u0301", "\u00e9")
        assert ours.decode(with_specials) == theirs.decode(with_specials)


def test_special_tokens_in_text_are_single_ids(qwen_dir):
    tok = load_tokenizer(qwen_dir)
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == start and ids[-1] == end
    assert tok.eos_id == end and tok.pad_id == tok.token_to_id("<|endoftext|>")
    assert tok.bos_id == -1 and not tok.add_bos_token
    assert tok.id_to_piece(end) == "<|im_end|>"
    assert tok.token_to_id("no such token") is None


def test_llama3_bos_comes_from_the_post_processor(llama3_dir):
    tok = load_tokenizer(llama3_dir)
    assert tok.add_bos_token and not tok.add_eos_token
    assert tok.encode("hi", add_bos=True)[0] == tok.token_to_id("<|begin_of_text|>")
    assert tok.eos_id == tok.token_to_id("<|eot_id|>")


def test_missing_special_token_is_added_like_transformers(tmp_path):
    config = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    directory = build_bpe(tmp_path / "t", config)
    ours, theirs = load_tokenizer(directory), auto(directory)
    assert ours.pad_id == theirs.pad_token_id == ours.vocab_size - 1
    text = "x<|pad|>y"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("clean", [True, False])
def test_decode_clean_up_matches_transformers(tmp_path, clean):
    """``clean_up_tokenization_spaces`` of a model that is not BPE (word-level): the space
    before punctuation and contractions is dropped as transformers' decode drops it."""
    from helpers import write_chatml_tokenizer

    words = ["why", "yes", ".", "?", "!", ",", "'", "it", "n't", "'m", "'s", "'ve", "'re"]
    directory = write_chatml_tokenizer(tmp_path, words, clean_up_tokenization_spaces=clean)
    ours, theirs = load_tokenizer(directory), auto(directory)
    ids = [ours.token_to_id(w) for w in words]
    assert ours.decode(ids) == theirs.decode(ids) and (" ," in ours.decode(ids)) != clean


def test_special_tokens_map_and_chat_template_file(qwen_dir, tmp_path):
    directory = tmp_path / "d"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((qwen_dir / "tokenizer.json").read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "ignored"}))
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "<|endoftext|>", "lstrip": False}})
    )
    (directory / "chat_template.jinja").write_text(CHATML)
    ours, theirs = load_tokenizer(directory), auto(directory)
    assert ours.eos_id == theirs.eos_token_id == ours.token_to_id("<|endoftext|>")
    assert ours.chat_template == CHATML == theirs.chat_template


def test_json_preferred_over_model_and_missing_dir(qwen_dir, tmp_path):
    directory = tmp_path / "both"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((qwen_dir / name).read_bytes())
    (directory / "tokenizer.model").write_bytes(b"not read")
    assert isinstance(load_tokenizer(directory), HFTokenizer)
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        load_tokenizer(tmp_path / "both" / "..")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "gone")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "bad")


@pytest.mark.parametrize("name", ["qwen_dir", "llama3_dir"])
def test_save_reloads_in_both(request, name, tmp_path):
    original = load_tokenizer(request.getfixturevalue(name))
    written = original.save(tmp_path / "saved")
    assert {p.name for p in written} == {"tokenizer.json", "tokenizer_config.json"}
    again, theirs = load_tokenizer(tmp_path / "saved"), auto(tmp_path / "saved")
    assert again.fingerprint == original.fingerprint
    assert (again.bos_id, again.eos_id, again.pad_id) == (
        original.bos_id,
        original.eos_id,
        original.pad_id,
    )
    assert again.add_bos_token == original.add_bos_token
    assert again.chat_template == original.chat_template == theirs.chat_template
    for text in MIXED_TEXTS:
        assert again.encode(text) == original.encode(text)
        assert again.encode(text, add_bos=again.add_bos_token) == theirs.encode(text)


# --------------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_chatml_matches_apply_chat_template(qwen_dir, conversation, generation_prompt):
    messages = CONVERSATIONS[conversation]
    ours = ChatTemplate.of(load_tokenizer(qwen_dir))
    expected = auto(qwen_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert ours.render(messages, add_generation_prompt=generation_prompt) == expected


@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_llama3_template_uses_bos_token(llama3_dir, conversation, generation_prompt):
    messages = CONVERSATIONS[conversation]
    tok = load_tokenizer(llama3_dir)
    theirs = auto(llama3_dir)
    text = ChatTemplate.of(tok).render(messages, add_generation_prompt=generation_prompt)
    expected = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert text == expected and text.startswith("<|begin_of_text|>")
    assert tok.encode(text) == theirs.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory) -> Path:
    """A tiny SentencePiece model with a Llama-2 config and chat template."""
    directory = tmp_path_factory.mktemp("sp")
    tok = Tokenizer.train(training_lines(200), directory / "tokenizer.model", 320)
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "legacy": False,
        "add_prefix_space": False,
        "chat_template": LLAMA2,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert tok.bos_id == 1
    return directory


@pytest.mark.parametrize("conversation", ["single", "system", "multi"])
def test_llama2_template_matches_and_encodes_bos_text(sp_dir, conversation):
    messages = CONVERSATIONS[conversation]
    tok = load_tokenizer(sp_dir)
    theirs = auto(sp_dir)
    text = ChatTemplate.of(tok).render(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids == theirs.encode(text, add_special_tokens=False)


def test_raise_exception_and_bad_templates():
    bad_roles = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="must alternate"):
        render_chat(LLAMA2, bad_roles, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match="compile"):
        render_chat("{% for %}", [{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        render_chat(CHATML, [])


def test_template_features_match_transformers(qwen_dir):
    template = (
        "{% for m in messages %}{{ m | tojson }}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
        "{{ tools | tojson }}{{ eos_token }}"
    )
    messages = [{"role": "user", "content": "<b>naïve</b> 'q'"}] * 3
    theirs = auto(qwen_dir)
    expected = theirs.apply_chat_template(messages, tokenize=False, chat_template=template)
    got = render_chat(template, messages, special_tokens=load_tokenizer(qwen_dir).special_tokens)
    assert got == expected


# ------------------------------------------------------------------------------ SentencePiece


def test_sentencepiece_directory_loads_and_round_trips(sp_dir):
    tok = load_tokenizer(sp_dir)
    assert isinstance(tok, Tokenizer) and isinstance(tok, TextTokenizer)
    theirs = auto(sp_dir)
    assert tok.add_bos_token and tok.chat_template == LLAMA2
    for text in [t for t in MIXED_TEXTS if "<|" not in t] + ["<s>x</s> y <unk>"]:
        ids = tok.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert tok.encode(text, add_bos=True) == theirs.encode(text)
        if "<" not in text:
            assert tok.decode(ids) == text
    # Tokenizer.load knows no config: special names stay text, as before.
    plain = Tokenizer.load(sp_dir)
    assert plain.decode(plain.encode("<s>x")) == "<s>x"
    assert plain.fingerprint != tok.fingerprint


def test_sentencepiece_save_reloads_in_both(tmp_path):
    trained = Tokenizer.train(training_lines(200), tmp_path / "m.model", 320)
    written = trained.save(tmp_path / "saved")
    assert {p.name for p in written} == {"tokenizer.model", "tokenizer_config.json"}
    again = load_tokenizer(tmp_path / "saved")
    theirs = auto(tmp_path / "saved")
    assert isinstance(again, Tokenizer)
    assert (again.bos_id, again.eos_id, again.pad_id) == (1, 2, 3)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (1, 2, 3)
    for text in [t for t in MIXED_TEXTS if "<|" not in t] + ["<s>x</s> y <pad>"]:
        assert again.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert again.encode(text, add_bos=again.add_bos_token) == theirs.encode(text)
    text = "def f(x):\n\treturn  x  # naïve 🙂"
    assert again.decode(again.encode(text)) == text == theirs.decode(theirs.encode(text)[1:])


# A checkpoint's second template for conversations with tools (transformers' "tool_use").
TOOL_USE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}"
    "{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("written_by", ["transformers", "ours"])
def test_a_tool_use_template_renders_conversations_with_tools(qwen_dir, tmp_path, written_by):
    """Named templates as transformers writes them (``additional_chat_templates/``) and as we
    do (the list form): with tools the ``tool_use`` one renders, as ``apply_chat_template``
    picks it; without, the default; both survive our save and read back in transformers."""
    from transformer_jax.tokenizer.chat import template_source

    theirs = auto(qwen_dir)
    theirs.chat_template = {"default": CHATML, "tool_use": TOOL_USE}
    theirs.save_pretrained(str(tmp_path / "hf"))
    directory = tmp_path / "hf"
    if written_by == "ours":
        assert (directory / "additional_chat_templates" / "tool_use.jinja").is_file()
        load_tokenizer(directory).save(tmp_path / "ours")
        directory = tmp_path / "ours"
        assert not (directory / "additional_chat_templates").exists()
    ours, theirs = load_tokenizer(directory), auto(directory)
    assert template_source(ours, TOOLS) == TOOL_USE and template_source(ours) == CHATML
    assert ours.config.named_templates == {"tool_use": TOOL_USE}
    messages = CONVERSATIONS["system"]
    for tools in (TOOLS, None):
        expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False,
                                              add_generation_prompt=True)
        rendered = ChatTemplate.of(ours, tools).render(messages, add_generation_prompt=True,
                                                       tools=tools)
        assert rendered == expected
    with_tools = ChatTemplate.of(ours, TOOLS).render(messages, tools=TOOLS)
    assert with_tools.startswith("<|im_start|>system\ntools: get_weather")
