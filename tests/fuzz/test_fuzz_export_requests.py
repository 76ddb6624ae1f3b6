"""Property: any ``age_encryption_recipients`` value is parsed or refused with an
`EngineUserError` naming the field (and the entry), never another exception; what is accepted
encrypts and decrypts. The same check runs in the embedded engine and at the server's door."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinker_sr.user_errors import EngineUserError
from tinker_sr.validation import MAX_AGE_RECIPIENTS, age_recipients

pyrage = pytest.importorskip("pyrage")

_KEYS = [pyrage.x25519.Identity.generate() for _ in range(3)]
_GOOD = [str(k.to_public()) for k in _KEYS]
_TEXT = st.one_of(
    st.sampled_from(_GOOD),
    st.sampled_from(["", " ", "age1", "AGE1" + _GOOD[0][4:], _GOOD[0][:-1], _GOOD[0] + "q"]),
    st.sampled_from(["ssh-ed25519", "ssh-rsa AAAA", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAA"]),
    st.text(max_size=80),
)
_ENTRY = st.one_of(_TEXT, st.integers(), st.none(), st.binary(max_size=8), st.floats())
_VALUE = st.one_of(
    st.none(),
    st.lists(_ENTRY, max_size=MAX_AGE_RECIPIENTS + 2),
    st.tuples(_TEXT),
    _TEXT,
    st.integers(),
    st.dictionaries(st.text(max_size=4), _TEXT, max_size=2),
)


@given(_VALUE)
def test_recipients_parse_or_refuse_by_field(value: Any) -> None:
    try:
        parsed = age_recipients(value)
    except EngineUserError as e:
        assert str(e).startswith("age_encryption_recipients"), str(e)
        return
    if value is None:
        assert parsed == []
        return
    assert 1 <= len(parsed) <= MAX_AGE_RECIPIENTS
    sealed = pyrage.encrypt(b"adapter", parsed)
    readers = [k for k, text in zip(_KEYS, _GOOD, strict=True) if text in value]
    assert readers and all(pyrage.decrypt(sealed, [k]) == b"adapter" for k in readers)
