"""Property: the engine's incremental stop-string matcher (`engine.stops.StopStrings`, which
keeps only the last bytes of each row) stops every row at the very token where the row's
whole output, as bytes, first holds a stop string, whatever the tokens' bytes (pieces of
UTF-8 characters, empty special tokens, ids past the table) and stop strings, with the rows'
tokens pushed in turns, in a random order each turn."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ
from tinker_sr.engine.stops import StopStrings

ALPHABET = "ab \néx😀"
# The tokens' bytes: each byte of the alphabet alone (so a stop string can be spelled byte by
# byte), pieces of several bytes, and nothing (a special token).
BYTES = sorted(set(ALPHABET.encode("utf-8")))
TABLE = [bytes([b]) for b in BYTES] + [b"ab", b"\xc3\xa9", b"\xf0\x9f", b"\x98\x80", b"a\xc3", b""]


def _spelled(text: str) -> list[int]:
    """``text``'s tokens, byte by byte."""
    return [BYTES.index(b) for b in text.encode("utf-8")]


def _first_stop(stops: list[str], table: list[bytes], row: list[int]) -> int | None:
    """The reference: the first prefix length whose bytes hold a stop string, or None."""
    patterns = [s.encode("utf-8") for s in stops]
    out = b""
    for k, t in enumerate(row, 1):
        out += table[t] if 0 <= t < len(table) else b""
        if any(p in out for p in patterns):
            return k
    return None


@FUZZ
@given(data=st.data(), order=st.randoms(use_true_random=False))
def test_each_row_stops_where_its_bytes_first_hold_a_stop_string(
    data: st.DataObject, order: object
) -> None:
    stops = data.draw(
        st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), min_size=1, max_size=3)
    )
    # rows: random tokens, and stop strings (or their starts) spelled byte by byte among them
    segment = st.one_of(
        st.lists(st.integers(-1, len(TABLE)), min_size=1, max_size=3),
        st.sampled_from(stops).flatmap(
            lambda s: st.integers(1, len(s)).map(lambda n: _spelled(s[:n]))
        ),
    )
    rows = data.draw(
        st.lists(st.lists(segment, max_size=4).map(lambda g: [t for x in g for t in x]),
                 min_size=1, max_size=3)
    )  # fmt: skip
    matcher = StopStrings(stops, TABLE, len(rows))
    pushes = [(r, k) for r, row in enumerate(rows) for k in range(len(row))]
    order.shuffle(pushes)  # type: ignore[attr-defined]
    pushes.sort(key=lambda p: p[1])  # each row's tokens in order, rows' turns shuffled
    stopped: dict[int, int] = {}
    for r, k in pushes:
        if r not in stopped and matcher.push(r, rows[r][k]):
            stopped[r] = k + 1
    for r, row in enumerate(rows):
        assert stopped.get(r) == _first_stop(stops, TABLE, row), (r, row)
