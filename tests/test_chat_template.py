"""FastTokenizer (the tokenizer a model directory gets without transformers) renders chat
templates as transformers does: the Hub's templates use transformers' `tojson`,
`raise_exception`, `strftime_now`, loop controls and `{% generation %}`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
import jinja2  # noqa: E402
import transformers  # noqa: E402
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
    assert ours.apply_chat_template(CHAT, **kwargs) == dict(expected)
    assert ours.apply_chat_template(CHAT, return_dict=False, **kwargs) == expected["input_ids"]


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


def _observed(out: Any) -> Any:
    """What user code reads off an ``apply_chat_template`` result."""
    if isinstance(out, (str, list)):
        return type(out).__name__, out
    if not hasattr(out, "keys"):  # a tensor or an array: return_dict=False with return_tensors
        return type(out).__module__.split(".")[0], out.tolist(), tuple(out.shape)
    values = {
        k: v if isinstance(v, list) else (type(v).__module__, v.tolist()) for k, v in out.items()
    }
    return {
        "isinstance dict": isinstance(out, dict),
        "keys": list(out),
        "len": len(out),
        "['input_ids'] and .input_ids": (values["input_ids"], out.input_ids is out["input_ids"]),
        "dict(out)": values,
        "'input_ids' in out": "input_ids" in out,
        "out[0] (the Encoding)": (out[0].ids, out[0].tokens, out[-1].attention_mask),
        "out[:1]": [e.ids for e in out[:1]],
        "is_fast": out.is_fast,
    }


@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5, reason="transformers 4 returns a list"
)
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"tokenize": True},
        {"add_generation_prompt": True},
        {"return_dict": True},
        {"return_dict": False},
        {"add_generation_prompt": True, "return_dict": False},
        {"tokenize": False},
        {"tokenize": False, "return_dict": True},
        {"return_tensors": "pt"},
        {"return_tensors": "np"},
        {"return_tensors": "pt", "return_dict": False},
    ],
    ids=repr,
)
def test_tokenize_returns_what_transformers_5_returns(
    model_dir: Path, kwargs: dict[str, Any]
) -> None:
    """Before: a plain list where transformers 5 returns its BatchEncoding (so
    ``out["input_ids"]`` raised TypeError and ``len(out)`` counted tokens, not 2 fields), and
    ``return_tensors`` was passed to the template unread."""
    ours, theirs = FastTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    expected = _observed(theirs.apply_chat_template(CHAT, **kwargs))
    assert _observed(ours.apply_chat_template(CHAT, **kwargs)) == expected


def test_a_python_tokenizer_s_encoding_cuts_by_slice(tmp_path: Path) -> None:
    """The built-in models' byte tokenizer has no `tokenizers.Encoding`: an integer index is
    a KeyError and a slice cuts each field, as transformers' Python tokenizers give."""
    from tinker_sr.tokenization.byte import ByteTokenizer

    out = ByteTokenizer().apply_chat_template(CHAT, chat_template=HUB_TEMPLATE)
    ids = ByteTokenizer().apply_chat_template(CHAT, chat_template=HUB_TEMPLATE, return_dict=False)
    assert len(out) == 2 and out.input_ids == out["input_ids"] == ids and not out.is_fast
    assert out[:3] == {"input_ids": ids[:3], "attention_mask": [1, 1, 1]}
    with pytest.raises(KeyError, match="Invalid key"):
        out[0]


def test_tokenizing_a_chat_imports_no_transformers(model_dir: Path) -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tinker_sr.tokenization.hf import FastTokenizer\n"
        f"tok = FastTokenizer(Path({str(model_dir)!r}))\n"
        "out = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], return_tensors='pt')\n"
        "assert out['input_ids'].shape[0] == 1 and len(out) == 2, out\n"
        "assert 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_a_chat_template_file_wins_over_the_config_as_in_transformers(tmp_path: Path) -> None:
    """A directory with both chat_template.jinja and tokenizer_config.json's chat_template:
    transformers renders the file's. Before: FastTokenizer rendered the config's."""
    root = make_tiny_hf_model_dir(tmp_path / "m")
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "OLD:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    (root / "chat_template.jinja").write_text(
        "NEW:{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    )
    chat = [{"role": "user", "content": "hi"}]
    theirs = AutoTokenizer.from_pretrained(root).apply_chat_template(chat, tokenize=False)
    assert theirs.startswith("NEW:")
    assert FastTokenizer(root).apply_chat_template(chat, tokenize=False) == theirs


def test_a_tokenizer_naming_its_own_code_loads_from_its_tokenizer_json(tmp_path: Path) -> None:
    """tokenizer_config.json's auto_map names a class in the directory's Python code: the
    tokenizer.json beside it describes the tokenizer, so it loads without running that code
    (and without transformers' interactive trust_remote_code prompt). Before: an error cut
    mid-word ("... `trust_remote_cod") that asked for a tokenizer.json that was there."""
    from tinker_sr.tokenization.hf import load_hf_tokenizer

    # Llama 3 (for Qwen3, transformers loads its own class and ignores the auto_map)
    root = make_tiny_hf_model_dir(tmp_path / "m", family="llama3")
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="XTokenizer", auto_map={"AutoTokenizer": ["tok_x.XTokenizer", None]})
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    ran = tmp_path / "ran"
    (root / "tok_x.py").write_text(f"open({str(ran)!r}, 'w').close()\nraise SystemExit(1)\n")
    tok = load_hf_tokenizer(root)
    assert tok.encode("hello world") == FastTokenizer(root).encode("hello world")
    assert not ran.exists()
    (root / "tokenizer.json").unlink()  # nothing describes it but its code: one clear line
    with pytest.raises(EngineUserError, match="auto_map names a tokenizer class in Python code"):
        load_hf_tokenizer(root)
    assert not ran.exists()


def test_a_transformers_5_directory_loads_under_transformers_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a hunt (transformers 4.45 beside tinker_sr): a directory transformers 5 saved
    names its tokenizer class "TokenizersBackend", which 4.x does not have (its tokenizer.json
    reads fine), and transformers before 4.47 does not read chat_template.jinja. Both are
    played here on transformers' loader; tinker_sr reads tokenizer.json / the template itself."""
    from tinker_sr.tokenization.hf import load_hf_tokenizer

    root = make_tiny_hf_model_dir(tmp_path / "m")
    (root / "chat_template.jinja").write_text("J:{{ messages[0]['content'] }}")
    chat = [{"role": "user", "content": "hi"}]
    real = AutoTokenizer.from_pretrained

    def unknown_class(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            "Tokenizer class TokenizersBackend does not exist or is not currently imported."
        )

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", unknown_class)
    tok = load_hf_tokenizer(root)
    assert isinstance(tok, FastTokenizer) and tok.encode("hello") == real(root).encode("hello")

    config_template = json.loads((root / "tokenizer_config.json").read_text())["chat_template"]

    def before_4_47(*args: Any, **kwargs: Any) -> Any:
        loaded = real(*args, **kwargs)
        loaded.chat_template = config_template  # chat_template.jinja not read
        return loaded

    from importlib import metadata

    version = metadata.version
    monkeypatch.setattr(
        metadata, "version", lambda name: "4.46.3" if name == "transformers" else version(name)
    )
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", before_4_47)
    assert load_hf_tokenizer(root).apply_chat_template(chat, tokenize=False) == "J:hi"


def test_a_named_template_is_rendered_by_its_name_as_in_transformers(tmp_path: Path) -> None:
    """tokenizer_config.json's list of named templates (as transformers 4 saved them):
    ``chat_template="tool_use"`` renders that one. Before: the string "tool_use" itself."""
    root = make_tiny_hf_model_dir(tmp_path / "m")
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": "D:{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T:{{ messages[0]['content'] }}"},
    ]
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    chat = [{"role": "user", "content": "hi"}]
    theirs = AutoTokenizer.from_pretrained(root)
    for name in (None, "tool_use"):
        want = theirs.apply_chat_template(chat, tokenize=False, chat_template=name)
        got = FastTokenizer(root).apply_chat_template(chat, tokenize=False, chat_template=name)
        assert got == want and want == ("T:hi" if name else "D:hi")
