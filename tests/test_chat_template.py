"""FastTokenizer (the tokenizer a model directory gets without transformers) renders chat
templates as transformers does: the Hub's templates use transformers' `tojson`,
`raise_exception`, `strftime_now`, loop controls and `{% generation %}`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
import jinja2  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir  # noqa: E402
from tinker_sr.tokenization.hf import FastTokenizer  # noqa: E402
from tinker_sr.user_errors import EngineUserError  # noqa: E402

# What Hub templates (Qwen3's tool calls, Llama 3's date header, Mistral's role checks) rely on.
HUB_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>{% endif %}{{ strftime_now('%Y') | length }}"
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] | tojson(indent=1) }}"
    "{% endif %}<|im_end|>\n{% if loop.index > 6 %}{% break %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if eos_token is defined %}[{{ eos_token }}]{% endif %}{{ extra | default('') }}"
)
TOOL = {
    "type": "function",
    "function": {"name": "weather", "description": "a < b & 'c' — é", "parameters": {"z": 1}},
}
CHAT = [
    {"role": "user", "content": "héllo <b> & 'x'"},
    {"role": "tool", "content": "ignored"},
    {"role": "assistant", "content": "ça va"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_tiny_hf_model_dir(tmp_path_factory.mktemp("chat") / "m")
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["chat_template"] = HUB_TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    return root


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"tools": [TOOL]}, {"add_generation_prompt": True, "extra": "!"}],
    ids=["plain", "tools", "generation-prompt+extra"],
)
def test_a_hub_style_template_renders_as_in_transformers(
    model_dir: Path, kwargs: dict[str, Any]
) -> None:
    ours, theirs = FastTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    text = ours.apply_chat_template(CHAT, tokenize=False, **kwargs)
    assert text == theirs.apply_chat_template(CHAT, tokenize=False, **kwargs)
    assert "é" in text and "<b>" in text and "\\u00e9" not in text and "&lt;" not in text
    assert ("<tools>" in text) == ("tools" in kwargs) and "ignored" not in text
    expected = theirs.apply_chat_template(CHAT, tokenize=True, return_dict=True, **kwargs)
    assert ours.apply_chat_template(CHAT, return_dict=True, **kwargs) == dict(expected)
    assert ours.apply_chat_template(CHAT, **kwargs) == expected["input_ids"]


def test_a_template_raise_exception_is_a_template_error_as_in_transformers(
    model_dir: Path,
) -> None:
    bad = [{"role": "narrator", "content": "x"}]
    for tok in (FastTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)):
        with pytest.raises(jinja2.TemplateError, match="Unknown role: narrator"):
            tok.apply_chat_template(bad, tokenize=False)


def test_what_needs_transformers_is_refused_by_name(model_dir: Path, tmp_path: Path) -> None:
    ours = FastTokenizer(model_dir)
    with pytest.raises(EngineUserError, match=r"continue_final_message=.*needs transformers"):
        ours.apply_chat_template(CHAT, continue_final_message=True)
    with pytest.raises(EngineUserError, match=r"tools=.*JSON schema"):
        ours.apply_chat_template(CHAT, tools=[len])
    with pytest.raises(EngineUserError, match=r"each a dict"):
        ours.apply_chat_template(["hi"])  # type: ignore[list-item]
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(EngineUserError, match="no chat_template .*pass chat_template="):
        FastTokenizer(bare).apply_chat_template(CHAT)
    assert FastTokenizer(bare).apply_chat_template(
        CHAT, chat_template=HUB_TEMPLATE, tokenize=False
    ) == ours.apply_chat_template(CHAT, tokenize=False)
