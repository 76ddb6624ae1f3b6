"""Chat templates rendered without transformers, in the environment transformers gives them.

Templates from the Hub rely on more than plain jinja2: the ``tojson`` filter as transformers
defines it (non-ASCII kept, key order kept, no HTML escaping: jinja2's own escapes ``<``, ``>``,
``&`` and ``'``), the ``raise_exception`` and ``strftime_now`` globals, ``{% break %}`` /
``{% continue %}`` and the ``{% generation %}`` block (assistant-token tracking; here it renders
its body). `render` builds that environment, sandboxed and immutable as in transformers, so a
template renders to the same text with or without transformers installed.
"""

from __future__ import annotations

import json
from collections import UserDict
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from tinker_sr.user_errors import EngineUserError

# Keyword arguments of transformers' apply_chat_template that change what it returns, which the
# plain renderer does not implement: refused by name rather than passed to the template unread.
NEEDS_TRANSFORMERS = ("continue_final_message", "return_assistant_tokens_mask")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise EngineUserError("apply_chat_template needs `jinja2`; pip install jinja2") from e

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: the body, rendered as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return str(caller())

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render(
    template: str,
    conversation: Sequence[dict[str, Any]],
    *,
    name: str,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    tools: Sequence[Any] | None = None,
    documents: Sequence[Any] | None = None,
    **kwargs: Any,
) -> str:
    """`template` rendered for `conversation` as transformers renders it: ``messages``,
    ``tools``, ``documents``, ``add_generation_prompt``, the special tokens (``bos_token``,
    ...) and any other keyword as template variables. `name` (the tokenizer's path) names the
    tokenizer in errors."""
    if unsupported := [k for k in NEEDS_TRANSFORMERS if kwargs.get(k)]:
        raise EngineUserError(
            f"{name}: apply_chat_template({unsupported[0]}=...) needs transformers (this "
            "tokenizer renders chat templates without it): pip install transformers, or leave "
            f"{unsupported[0]} unset"
        )
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise EngineUserError(
            f"{name}: apply_chat_template(tools=...) takes JSON schemas (dicts) here; a Python "
            "function as a tool needs transformers to read its signature: pip install "
            "transformers, or pass its JSON schema"
        )
    if not all(isinstance(m, dict) for m in conversation):
        raise EngineUserError(
            f"{name}: apply_chat_template takes a list of messages, each a dict such as "
            "{'role': 'user', 'content': 'hi'}"
        )
    variables = {k: v for k, v in kwargs.items() if k not in NEEDS_TRANSFORMERS}
    return str(
        _compiled(template).render(
            messages=list(conversation),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
            **variables,
        )
    )


class ChatEncoding(UserDict[str, Any]):
    """What transformers 5's ``apply_chat_template`` returns by default (its ``BatchEncoding``,
    without importing transformers): a mapping (not a `dict`) of ``input_ids`` and
    ``attention_mask``, so ``out["input_ids"]``, ``out.input_ids``, ``len(out) == 2``,
    ``dict(out)``, ``model(**out)`` and ``out.to(device)`` work as there. An integer index is
    the `tokenizers.Encoding` where a fast tokenizer made one (``out[0]``); otherwise, as for
    transformers' Python tokenizers, a slice cuts every field and an integer is a `KeyError`."""

    def __init__(self, data: dict[str, Any], encodings: list[Any] | None = None) -> None:
        super().__init__(data)
        self._encodings = encodings

    def __getitem__(self, item: Any) -> Any:
        if isinstance(item, str):
            return self.data[item]
        if self._encodings is not None:
            return self._encodings[item]
        if isinstance(item, slice):
            return {key: value[item] for key, value in self.data.items()}
        raise KeyError(
            "Invalid key. Only three types of key are available: (1) string, (2) integers for "
            "backend Encoding, and (3) slices for data subsetting."
        )

    def __getattr__(self, item: str) -> Any:
        try:
            return self.__dict__["data"][item]
        except KeyError:
            raise AttributeError(item) from None

    @property
    def encodings(self) -> list[Any] | None:
        """The `tokenizers.Encoding` of the text (a fast tokenizer's), else ``None``."""
        return self._encodings

    @property
    def is_fast(self) -> bool:
        return self._encodings is not None

    def to(self, device: Any) -> ChatEncoding:
        """Tensors moved to ``device`` (``return_tensors="pt"``); self, as in transformers."""
        self.data = {k: v.to(device) if hasattr(v, "to") else v for k, v in self.data.items()}
        return self


def _tensors(rows: list[int], kind: str | None, name: str) -> Any:
    """``rows`` as ``return_tensors`` asks: a list, or a batch of one (shape ``[1, n]``)."""
    if kind is None:
        return rows
    if kind == "pt":
        import torch

        return torch.tensor([rows], dtype=torch.long)
    if kind == "np":
        import numpy as np

        return np.array([rows], dtype=np.int64)
    raise EngineUserError(
        f"{name}: apply_chat_template(return_tensors={kind!r}): this tokenizer returns 'pt', "
        "'np' or lists (None); other frameworks need transformers"
    )


def apply(
    tokenizer: Any,
    conversation: Sequence[dict[str, Any]],
    *,
    template: str | None,
    missing: str,
    special_tokens: dict[str, str | None],
    tokenize: bool,
    return_dict: bool,
    add_generation_prompt: bool,
    return_tensors: str | None = None,
    **kwargs: Any,
) -> Any:
    """A tokenizer's ``apply_chat_template``: `template` rendered (`render`; `missing` says
    what to do where there is none), then, unless ``tokenize=False``, its ids without added
    special tokens (the template writes them): with ``return_dict`` (transformers 5's
    default) a `ChatEncoding` of ``input_ids`` and ``attention_mask``, else the ids alone; as
    lists, or tensors with a batch axis of one (``return_tensors``)."""
    name = str(tokenizer.name_or_path)
    if not template:
        raise EngineUserError(f"{name}: {missing}")
    text = render(
        template,
        conversation,
        name=name,
        add_generation_prompt=add_generation_prompt,
        special_tokens={k: v for k, v in special_tokens.items() if v is not None},
        **kwargs,
    )
    if not tokenize:
        return text
    fast = getattr(tokenizer, "_fast_encoding", None)  # a `tokenizers.Encoding`, when it has one
    encoding = fast(text) if fast is not None else None
    ids = (
        list(encoding.ids)
        if encoding is not None
        else tokenizer.encode(text, add_special_tokens=False)
    )
    input_ids = _tensors(ids, return_tensors, name)
    if not return_dict:
        return input_ids
    data = {
        "input_ids": input_ids,
        "attention_mask": _tensors([1] * len(ids), return_tensors, name),
    }
    return ChatEncoding(data, None if encoding is None else [encoding])
