"""A byte-level BPE tokenizer read from an HF checkpoint folder (``tokenizer.json`` + ``tokenizer_config.json``)
with the ``tokenizers`` library, and its chat template rendered with jinja2 the way transformers renders it.

Works for the project's own ``pipeline/assets/dsv3-tiny-pydoc`` (DeepSeek-V3 special tokens and chat
template) and for any checkpoint whose config names its bos/eos tokens; without a ``chat_template`` only
:meth:`Tokenizer.apply_chat_template` fails. Paths may be fsspec URLs (read through :mod:`pipeline.io.storage`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from pipeline.io import storage

# DeepSeek-V3's special tokens (U+FF5C full-width bar, U+2581 lower one-eighth block), in its id order.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT)

# DeepSeek-V3's template without the tool-call branches: bos, the system prompts joined by blank lines,
# then user and assistant turns (an assistant's "</think>" reasoning dropped), then "<｜Assistant｜>"
# when a reply is wanted.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '" + ASSISTANT + "' + content + '" + EOS + "' }}"
    "{%- elif message['role'] != 'system' %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}{%- endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)


# Marks a special-token string inside message content while the template renders, so that only the
# template's own special tokens are parsed as such (a private-use character; one in the content itself is
# doubled, so the marking is lossless).
_MARK = "\ue000"
_UNMARK = re.compile(_MARK + "(" + _MARK + ")?")


# Longer texts are encoded with encode_batch, which releases the GIL (encode holds it: a large prompt
# tokenized on a worker thread would still stall the server's event loop).
RELEASE_GIL_CHARS = 4096


def _ids(tk: _HFTokenizer, text: str) -> list[int]:
    if len(text) > RELEASE_GIL_CHARS:
        return tk.encode_batch([text], add_special_tokens=False)[0].ids
    return tk.encode(text, add_special_tokens=False).ids


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be used; the message names the file."""


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str) -> jinja2.Template:
    """The template compiled once per text (as transformers caches it): compiling costs more than a chat
    request's tokenization; a compiled template renders concurrently (jinja2 templates are immutable)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, str]],
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Render a chat template as transformers does: a sandboxed jinja2 environment with trim_blocks and
    lstrip_blocks, ``raise_exception`` available, and the special tokens as variables."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(message.get("role"), str) or not (
                isinstance(content, str) or (content is None and message.get("tool_calls"))):
            raise TokenizerError(f"message {i} needs string 'role' and 'content', got {dict(message)!r}")
    try:
        compiled = _compiled_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not parse: {e}") from e
    return compiled.render(
        messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
        bos_token=bos_token, eos_token=eos_token, **extra,
    )


def _token_text(value: Any, key: str, where: str) -> str | None:
    """A special token as tokenizer_config writes it: a string, an AddedToken dict, or absent/null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where}: {key} must be a string or an AddedToken object, got {value!r}")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the special tokens and chat template of its ``tokenizer_config.json``."""

    def __init__(self, tokenizer: _HFTokenizer, config: Mapping[str, Any], config_path: str = "tokenizer_config"):
        self._tk = tokenizer
        # the same model with special-token strings encoded as ordinary text (for message content)
        self._plain = _HFTokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        specials = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)
        self._special_ids = {t: tokenizer.token_to_id(t) for t in specials}
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._config_path = config_path
        ids = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            text = _token_text(config.get(key), key, config_path)
            if text is None:
                if key != "pad_token":
                    raise TokenizerError(f"{config_path}: {key} is missing")
                ids[key] = None
                continue
            token_id = tokenizer.token_to_id(text)
            if token_id is None:
                raise TokenizerError(f"{config_path}: {key} {text!r} is not in the tokenizer's vocabulary")
            ids[key] = (text, token_id)
        (self.bos_token, self.bos_id), (self.eos_token, self.eos_id) = ids["bos_token"], ids["eos_token"]
        self.pad_token, self.pad_id = ids["pad_token"] or (None, None)
        template = config.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{config_path}: chat_template must be a string, got {type(template).__name__}")
        self.chat_template: str | None = template
        self.model_max_length: int | None = config.get("model_max_length")

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """Read ``tokenizer.json`` and ``tokenizer_config.json`` from a folder (local path or fsspec URL)."""
        tok_path = storage.join(path, "tokenizer.json")
        cfg_path = storage.join(path, "tokenizer_config.json")
        try:
            tok_text = storage.read_bytes(tok_path).decode("utf-8")
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{tok_path}: tokenizer.json not found") from e
        try:
            tokenizer = _HFTokenizer.from_str(tok_text)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for bad JSON
            raise TokenizerError(f"{tok_path}: not a tokenizers file: {e}") from e
        try:
            config = json.loads(storage.read_bytes(cfg_path))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{cfg_path}: tokenizer_config.json not found") from e
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerError(f"{cfg_path}: not valid JSON: {e}") from e
        if not isinstance(config, dict):
            raise TokenizerError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
        return cls(tokenizer, config, cfg_path)

    def to_json(self) -> str:
        """The ``tokenizer.json`` text of this tokenizer (what a grammar engine builds its own from)."""
        return self._tk.to_str()

    @property
    def vocab_size(self) -> int:
        """Number of ids, added (special) tokens included."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their single ids."""
        ids = _ids(self._tk, text)
        return [self.bos_id, *ids] if add_bos else ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` as ordinary text: a special-token string in it is split into ordinary
        tokens, never its special id."""
        return _ids(self._plain, text)

    @property
    def adds_bos_by_default(self) -> bool:
        """Whether plain HF tokenization (``tokenizer(text)``, special tokens on) starts with bos: what
        tokenizer.json's post-processor does. msModelSlim tokenizes calibration texts that way."""
        ids = self._tk.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_id

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special)

    def special_id(self, text: str) -> int | None:
        """The id of the special token ``text``; None when it is not one."""
        return self._special_ids.get(text)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            template: str | None = None, **extra: Any) -> str:
        """The chat as one string (bos included), rendered as transformers' ``apply_chat_template`` would
        (``template``: another template than the tokenizer's; ``extra``: more template variables)."""
        template = template or self.chat_template
        if template is None:
            raise TokenizerError(f"{self._config_path} has no chat_template: this tokenizer cannot format chats")
        return render_chat_template(
            template, [{k: v for k, v in m.items() if k != "trusted"} for m in messages], bos_token=self.bos_token,
            eos_token=self.eos_token, pad_token=self.pad_token, add_generation_prompt=add_generation_prompt, **extra,
        )

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    template: str | None = None, **extra: Any) -> list[int]:
        """Ids of :meth:`apply_chat_template`'s text; the template writes the bos, so none is added. Only
        the template's own structure yields special ids: a special-token string inside a message's
        content (or an assistant's tool call) is encoded as ordinary text (so no content can forge a turn
        or a system prompt); a message marked ``trusted`` (the server's own, such as the tools section of
        pipeline.serving.tool_calls) is rendered as the template's own text."""
        if self._special_re is None:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, template, **extra),
                               add_bos=False)
        marked = [m if m.get("trusted") else self._mark_message(m) for m in messages]
        text = self.apply_chat_template(marked, add_generation_prompt, template, **extra)
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):  # the template's special tokens (content's are marked)
            ids += self.encode_plain(self._unmark(text[pos:m.start()]))
            ids.append(self._special_ids[m.group()])
            pos = m.end()
        return ids + self.encode_plain(self._unmark(text[pos:]))

    def _mark_message(self, m: Mapping[str, Any]) -> dict:
        out = dict(m)
        if isinstance(m.get("content"), str):
            out["content"] = self._mark(m["content"])
        if isinstance(m.get("tool_calls"), list):
            out["tool_calls"] = [{**c, "function": {k: self._mark(v) if isinstance(v, str) else v
                                                    for k, v in c["function"].items()}}
                                 if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
                                 for c in m["tool_calls"]]
        return out

    def _mark(self, content: str) -> str:
        content = content.replace(_MARK, _MARK + _MARK)
        return self._special_re.sub(lambda m: m.group()[0] + _MARK + m.group()[1:], content)

    @staticmethod
    def _unmark(text: str) -> str:
        return _UNMARK.sub(lambda m: m.group(1) or "", text) if _MARK in text else text
