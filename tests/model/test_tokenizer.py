"""The tokenizer built from a GGUF encodes, decodes and renders chats exactly like transformers'.

Real model: SmolLM2-135M-Instruct, our `Tokenizer` read back from the converted `.rad`
header against `AutoTokenizer.from_pretrained(dir, gguf_file=...)` on the same GGUF.
Behaviour of the chat template environment is checked on a tiny vocabulary.
"""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from tokenizers import pre_tokenizers

from radianced.model.config import UnsupportedModel
from radianced.model.gguf_tokenizer import gguf_tokenizer
from radianced.model.rad import RadFile
from radianced.model.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  leading, internal   and trailing spaces   ",
    "tabs\tand\t\ttabs, newlines\n\n\nand CRLF\r\n",
    "    \n\t  \r\n",
    "안녕하세요, 세계! 한국어 텍스트입니다.",
    "中文字符和日本語のテキスト",
    "emoji 🤖🎉 family 👩‍👩‍👧 flag 🇰🇷",
    "Ünïcödé ÀÉÎÕÜ ß ﬁ ™ ©",
    "def square(x):\n    return x ** 2  # comment\n",
    'if (a && b) { printf("%d\\n", a[i]); }',
    "12345 + 67890 = 80235; pi = 3.14159",
    "don't I'll we've they're",
    "https://example.com/path?q=1&r=2#frag",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user",
    "a<|im_start|>b<|im_end|>c<|endoftext|>",
    "<|im_start <|im_end|> |>",  # a broken marker stays text
    "<repo_name>radianced<file_sep>gguf.py",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 한국어 and emoji 🤖."},
    ],
]


@pytest.fixture(scope="module")
def ours(smollm2_rad) -> Tokenizer:
    return Tokenizer.from_header(RadFile.open(smollm2_rad).header)


# -- SmolLM2 against transformers ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encodes_exactly_like_transformers_from_the_same_gguf(ours, smollm2_hf_tokenizer, text):
    ref = smollm2_hf_tokenizer
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == ref.encode(text)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_and_matches_transformers(ours, smollm2_hf_tokenizer, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids, skip_special_tokens=False) == smollm2_hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == smollm2_hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_special_tokens_in_text_are_single_ids(ours):
    assert ours.encode("<|im_start|>user") == [1, ours.encode("user")[0]]
    assert ours.encode("<|im_end|>") == [2]
    assert ours.decode([1, *ours.encode("user"), 2]) == "user"


@pytest.mark.slow
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system", "multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(ours, smollm2_hf_tokenizer, conversation, add_generation_prompt):
    expected = smollm2_hf_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.slow
def test_non_ascii_numerals_split_like_llama_cpp_not_like_transformers(ours, smollm2_hf_tokenizer):
    """SmolLM2's pre-tokenizer ("smollm" in llama.cpp, `Digits` + ByteLevel in its own
    tokenizer.json) isolates every numeric character before BPE. transformers' GGUF loader
    drops that step, which only shows on numerals that have merges: ASCII digits have none,
    "½" (bytes "Â½") does. We follow llama.cpp and the model's tokenizer."""
    half = ours.encode("½")
    assert half == [16738]  # "Â½"
    assert ours.encode(" ½") == [216, *half]  # "Ġ", "Â½"
    assert smollm2_hf_tokenizer.encode(" ½", add_special_tokens=False) == [3351, 138]  # "ĠÂ", "½"
    assert ours.encode(" 2024") == smollm2_hf_tokenizer.encode(" 2024", add_special_tokens=False)


@pytest.mark.slow
def test_smollm2_ids_and_sizes(ours, smollm2_hf_tokenizer):
    assert ours.vocab_size == len(smollm2_hf_tokenizer) == 49152
    assert ours.bos_token_id == 1 and ours.bos_token == "<|im_start|>" == smollm2_hf_tokenizer.bos_token
    assert ours.eos_token_ids == (2,) and ours.eos_token == "<|im_end|>" == smollm2_hf_tokenizer.eos_token


# -- the Tokenizer class on a tiny vocabulary ---------------------------------


def tiny_meta(**extra) -> dict:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt", "he"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["Ġ t", "h e"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **extra,
    }


def tiny(template: str | None) -> Tokenizer:
    return Tokenizer(gguf_tokenizer(tiny_meta()).to_str(), template, 1, (2, 0))


def test_template_sees_bos_and_eos_tokens_and_renders_with_trim_and_lstrip():
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{{ bos_token }}\n{% for m in messages %}\n  {% if m['role'] == 'user' %}\n"
        "{{ m['content'] }}{{ eos_token }}\n  {% endif %}\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    out = tiny(template).apply_chat_template(messages)
    assert out == "<|im_start|>\na<|im_end|>\nb<|im_end|>\n"
    (ref,), _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                      bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert out == ref


def test_template_raise_exception_becomes_chat_template_error():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    tok = tiny(template)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_no_chat_template_is_a_clear_error():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tiny(None).apply_chat_template([{"role": "user", "content": "x"}])


def test_broken_template_fails_at_load():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tiny("{% for m in messages %}")


def test_tojson_does_not_escape_html_and_strftime_now_works():
    template = "{{ messages[0] | tojson }}|{{ strftime_now('%Y') }}"
    out = tiny(template).apply_chat_template([{"role": "user", "content": "<a & b> 한"}])
    assert out == json.dumps({"role": "user", "content": "<a & b> 한"}, ensure_ascii=False) + f"|{datetime.now():%Y}"


def test_none_valued_keys_are_dropped_and_generation_tag_renders_its_body():
    template = (
        "{% for m in messages %}{% if m.content is defined %}{{ m.content }}{% else %}[tool call]{% endif %}"
        "{% generation %}!{% endgeneration %}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    tok = tiny(template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert tok.apply_chat_template(messages) == "hi![tool call]!>"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "hi![tool call]!"


def test_template_cannot_reach_python_internals():
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        tiny("{{ messages.__class__.__mro__ }}").apply_chat_template([{"role": "user", "content": "x"}])


def test_eos_ids_vocab_size_and_from_header_duck_typing():
    class Model:
        bos_token_id, eos_token_ids = 1, (2, 0)

    class Header:
        tokenizer_json, chat_template, model = gguf_tokenizer(tiny_meta()).to_str(), None, Model()

    tok = Tokenizer.from_header(Header())
    assert tok.eos_token_ids == (2, 0)
    assert tok.vocab_size == 3 + 256 + 2
    assert tok.encode(" the") == [259, 260]  # merges "Ġ t", "h e": the two merged tokens
    assert tok.decode([259, 260]) == " the"


def test_add_bos_and_add_eos_flags_drive_add_special_tokens():
    tok = Tokenizer(gguf_tokenizer(tiny_meta(**{"tokenizer.ggml.add_bos_token": True,
                                                "tokenizer.ggml.add_eos_token": True})).to_str(), None, 1, (2,))
    body = tok.encode("he")
    assert tok.encode("he", add_special_tokens=True) == [1, *body, 2]
    plain = tiny(None)
    assert plain.encode("he", add_special_tokens=True) == plain.encode("he")


def test_non_bpe_tokenizer_and_unknown_pre_tokenizer_are_refused():
    with pytest.raises(UnsupportedModel, match="'llama' is not supported"):
        gguf_tokenizer(tiny_meta(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(UnsupportedModel, match="pre-tokenizer 'mystery'"):
        gguf_tokenizer(tiny_meta(**{"tokenizer.ggml.pre": "mystery"}))
