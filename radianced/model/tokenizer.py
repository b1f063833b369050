"""Text <-> token ids and chat prompts, the same for every model family.

A `Tokenizer` wraps a Hugging Face `tokenizers` tokenizer (its `tokenizer.json`
text, as stored in the `.rad` header) and the model's Jinja chat template. The
template renders the way transformers' `apply_chat_template` renders it: a
sandboxed environment with `trim_blocks` / `lstrip_blocks`, `raise_exception`,
`strftime_now`, a non-escaping `tojson`, and `bos_token` / `eos_token` in scope.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: no template, or the template refused it."""


class Tokenizer:
    """Encode, decode and render chat prompts for one model.

    `tokenizer_json` is a `tokenizers` serialization (`Tokenizer.to_str()`); a
    malformed one raises here. `chat_template` is compiled here too, so a broken
    template fails at load, not on the first request. Immutable after construction.
    """

    def __init__(
        self,
        tokenizer_json: str,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
    ) -> None:
        self._tok = _HFTokenizer.from_str(tokenizer_json)
        self.tokenizer_json = tokenizer_json  # what it was built from (the HTTP front builds its own from it)
        self.bos_token_id = bos_token_id
        self._eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.bos_token = self._tok.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token = self._tok.id_to_token(self._eos_token_ids[0]) if self._eos_token_ids else None
        self.chat_template = chat_template
        self._template = _compile(chat_template) if chat_template else None

    @classmethod
    def from_header(cls, header) -> Tokenizer:
        """From a `.rad` header (anything with `.tokenizer_json`, `.chat_template`, `.model`)."""
        return cls(
            header.tokenizer_json,
            header.chat_template,
            header.model.bos_token_id,
            header.model.eos_token_ids,
        )

    # -- ids ------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (eos, and eot/eom where the model has them)."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for: its vocabulary string's UTF-8 length, an
        upper bound (byte-level BPE spells a byte with a character of one or two bytes,
        SentencePiece a space with three). A text of B bytes encodes to at least B / this tokens."""
        return max((len(t.encode()) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`. Special tokens written in the text (`<|im_start|>`)
        become their ids; `add_special_tokens` adds what the model's post-processor
        adds (a BOS for most llama files, nothing for SmolLM2).

        Releases the GIL while it tokenizes, so a worker thread can encode a long
        text while the event loop runs: tokenizers' `encode_batch` does, its `encode`
        does not (tokenizers 0.23, 1 MB of text: `encode` on a thread held the loop
        1.6 s; `encode_batch` 55 ms, the time to build the 420,000-id list)."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # -- chat -----------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The prompt text for `messages` (OpenAI-style dicts with `role`, `content`).

        Keys whose value is None are dropped first, as transformers does (APIs send
        `content: null` beside tool calls; templates test for a missing key).
        Extra `kwargs` (`tools`, `documents`, ...) are passed to the template.
        Raises `ChatTemplateError` when the model has no template or the template
        rejects the conversation (its `raise_exception`).
        """
        if self._template is None:
            raise ChatTemplateError(
                "this model has no chat template; send a plain completion request "
                "(/v1/completions) with the prompt already formatted"
            )
        for message in messages:
            if not isinstance(message, dict):
                raise ChatTemplateError(f"chat messages must be objects, got {message!r}")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        try:
            return self._template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from e


# -- template environment -----------------------------------------------------


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & for HTML; chat templates want the plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _compile(chat_template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(chat_template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e
