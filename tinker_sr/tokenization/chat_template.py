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
    **kwargs: Any,
) -> Any:
    """A tokenizer's ``apply_chat_template``: `template` rendered (`render`; `missing` says
    what to do where there is none), then, unless ``tokenize=False``, its ids without added
    special tokens (the template writes them), as a list or, with ``return_dict``, as
    ``{"input_ids", "attention_mask"}``."""
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
    ids = tokenizer.encode(text, add_special_tokens=False)
    return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids
