from __future__ import annotations

import pytest

from tinker_sr.tokenization.byte import ByteTokenizer, write_hf_tokenizer_dir


def test_bytes_and_special_ids() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        256, 259, 256, 257, 258,
    )  # fmt: skip
    assert tok.encode("hé", add_special_tokens=False) == [104, 195, 169]
    assert tok.encode("a") == tok.encode("a", add_special_tokens=True) == [256, 97]
    assert tok.decode([256, 104, 195, 169, 257]) == "<|bos|>hé<|eos|>"
    assert tok.decode([256, 104, 257], skip_special_tokens=True) == "h"
    assert tok.decode([195]) == "\ufffd"  # a cut multi-byte character is replaced, not an error
    assert tok("ab")["input_ids"] == [256, 97, 98]


def test_hf_tokenizer_dir_loads_offline_and_matches(tmp_path) -> None:
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    write_hf_tokenizer_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = ByteTokenizer()
    text = "Hello, world!\n  x = 1;\t{ok} ~end<|eos|>é<|pad|"
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    assert hf.encode(text) == ours.encode(text)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (256, 257, 258)
    assert (len(hf), hf.vocab_size) == (len(ours), ours.vocab_size) == (259, 256)
    assert hf.decode(ours.encode("héllo", add_special_tokens=False)) == "héllo"
    # The rest of the interface scripts use, as the server's tokenizer has it in transformers.
    ids = ours.encode(text)
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.convert_tokens_to_ids(hf.convert_ids_to_tokens(ids)) == ids
    assert ours.convert_ids_to_tokens(257) == hf.convert_ids_to_tokens(257) == "<|eos|>"
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.all_special_tokens == hf.all_special_tokens
    rows = [ids, ours.encode("b", add_special_tokens=False)]
    assert ours.batch_decode(rows) == hf.batch_decode(rows)
    assert ours.batch_decode(rows, skip_special_tokens=True) == hf.batch_decode(
        rows, skip_special_tokens=True
    )
    chat = [{"role": "user", "content": "hi"}]
    for tok in (ours, hf):
        with pytest.raises(ValueError, match="chat.template"):
            tok.apply_chat_template(chat)
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"
    assert ours.apply_chat_template(
        chat, chat_template=template, return_dict=False
    ) == hf.apply_chat_template(chat, chat_template=template, return_dict=False)
    # By default both return an encoding (transformers 5), not the list of ids.
    theirs = hf.apply_chat_template(chat, chat_template=template)
    mine = ours.apply_chat_template(chat, chat_template=template)
    assert mine["input_ids"] == theirs["input_ids"] and len(mine) == len(theirs)


def test_every_builtin_model_is_a_byte_tokenizer_model() -> None:
    """The clients learn the built-in names from the tokenizer module, not the engine."""
    from tinker_sr.engine.model import BUILTIN_CONFIGS
    from tinker_sr.tokenization.byte import BYTE_TOKENIZER_MODELS

    assert sorted(BUILTIN_CONFIGS) == sorted(BYTE_TOKENIZER_MODELS)
    for cfg in BUILTIN_CONFIGS.values():
        assert (cfg.vocab_size, cfg.eos_token_id) == (
            len(ByteTokenizer()),
            ByteTokenizer.eos_token_id,
        )
