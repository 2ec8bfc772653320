"""Tokenizer over `tokenizers` (tokenizer.json) + tokenizer_config.json, and a streaming
detokenizer that never emits half a UTF-8 character.

No transformers import: the serving path only needs the fast tokenizer and the checkpoint's
own jinja chat template (rendered in jinja2's sandbox, as transformers does).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    """The checkpoint's tokenizer files are missing/malformed, or a template cannot render."""


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):   # {"content": "<s>", ...} in older tokenizer_config files
        return v.get("content")
    return v


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, config: dict[str, Any],
                 chat_template: str | None, eos_token_ids: Sequence[int]) -> None:
        self._tok = tok
        self.config = config
        self.chat_template = chat_template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._compiled = None
        self._variables: frozenset[str] | None = None
        self._max_token_bytes: int | None = None
        self.model_type: str | None = None      # config.json's (picks the tool-call parser)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path} not found (moed needs a fast tokenizer.json)")
        tok = _HFTokenizer.from_file(str(path))
        config = _read_json(d / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):   # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        # eos ids: generation_config first (it lists every stop id), then config, then tokenizer.
        eos: list[int] = []
        eos += _ids(_read_json(d / "generation_config.json").get("eos_token_id"))
        eos += _ids(_read_json(d / "config.json").get("eos_token_id"))
        eos_text = _token_text(config.get("eos_token"))
        if eos_text is not None and tok.token_to_id(eos_text) is not None:
            eos.append(tok.token_to_id(eos_text))
        out = cls(tok, config, template, eos)
        out.model_type = _read_json(d / "config.json").get("model_type")
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works, encode does not: a 4 MB prompt held
        # every other thread, the event loop included, for 4.4 s (measured here)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry (an over-estimate of the text one token
        covers: byte-level and metaspace symbols take 2-3 bytes for one byte of text)."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max((len(t.encode("utf-8", "replace"))
                                         for t in self._tok.get_vocab(with_added_tokens=True)),
                                        default=1) or 1
        return self._max_token_bytes

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), in O(1): each token covers at most
        max_token_bytes bytes and each character is at least one byte; the factor 2 leaves
        room for a normalizer that composes characters (NFC: e + U+0301 -> é)."""
        return len(text) // (2 * self.max_token_bytes)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """tokenizer.json's content (the structured-output engine builds its vocabulary from it)."""
        return self._tok.to_str()

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, *,
                            tools: Sequence[dict[str, Any]] | None = None,
                            continue_final_message: bool = False, **extra: Any) -> str:
        """Render the checkpoint's own chat template (the prompt text, special tokens included),
        as transformers does: `tools` (OpenAI-shaped function dicts, None when there are none)
        and `extra` (chat_template_kwargs) are template variables; continue_final_message cuts
        the text after the last message's content, so the model continues that message."""
        if not self.chat_template:
            raise TokenizerError("this checkpoint has no chat template; use the completions API")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        from jinja2.exceptions import TemplateError

        try:
            text = self._compiled.render(
                messages=list(messages), tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except (TemplateError, TypeError, ValueError, LookupError) as e:   # a 400, not a 500
            raise TokenizerError(f"chat template failed: {e}") from None
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final.strip():
                raise TokenizerError("continue_final_message needs a last message with text")
            # some templates trim messages (transformers tries the stripped text next, too)
            at = text.rfind(final)
            if at < 0:
                final = final.strip()
                at = text.rfind(final)
            if at < 0:
                raise TokenizerError("continue_final_message: the chat template does not "
                                     "render the last message's text")
            text = text[:at + len(final)]
        return text

    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads from its context (what chat_template_kwargs may
        set); empty without a template."""
        if self._variables is None:
            if not self.chat_template:
                self._variables = frozenset()
            else:
                from jinja2 import meta

                env = _compile(self.chat_template).environment
                self._variables = frozenset(
                    meta.find_undeclared_variables(env.parse(self.chat_template)))
        return self._variables


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: malformed JSON: {e}") from None


def _compile(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from None


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids.

    Text is held back while the decoded tail ends in U+FFFD (an incomplete UTF-8 char), and
    each step decodes only a short window (from `prefix` on) so the cost per token is O(1).
    The concatenation of all returned pieces plus `flush()` equals `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # A few prompt tokens give the window context (e.g. leading-space handling), unless
        # they end inside a UTF-8 character (a token-id prompt): then no context at all.
        ctx = list(prompt_ids[-4:])
        if ctx and self._decode(ctx).endswith("\ufffd"):
            ctx = []
        self.ids: list[int] = ctx
        self._prefix = 0                  # window start
        self._read = len(self.ids)        # ids up to here have been emitted
        self.text = ""                    # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Append new ids; return the newly decodable text ("" while a char is incomplete)."""
        self.ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full = self._decode(self.ids[self._prefix:])
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of a stream: whatever is still held back (possibly with U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full = self._decode(self.ids[self._prefix:])
        new = full[len(prefix_text):] if full.startswith(prefix_text) else ""
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new
