"""Answers streamed while the engine samples them, for the OpenAI- and Anthropic-compatible
routes (`handlers.oai`, `handlers.anthropic`).

The sampling worker tells a request's listener its rows' new tokens after the prefill and each
decode step (`engine.scheduler`, `LocalBackend.sample(..., progress=...)`); here each answer's
settled text (what later tokens cannot change) goes out as it grows, with its tokens' log-prob
entries where the request asked for them, in the route's own event format (a `Writer`), and
the whole answer's remainder, finish and usage at the end, so the pieces join to the very text
and log-probs the unstreamed answer has. The reply begins once the request (each of its
prompts) is decoding: whatever fails before that (the prompt, the model, the server's load) is
an error reply as for any request; what fails later ends the stream with an error event. A
client that goes away cancels its sample.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import Response, StreamingResponse

from tinker_sr.engine.sampler import NewTokens
from tinker_sr.tokenization.hf import byte_fallback, decode_answer

from .harmony import split_channels
from .http import plain_error
from .oai_format import Choice, OaiRequest, Piece, Sent, TokenEntry, cut_at_stop, unsent

# A streamed answer's events, at most this often once it has run 10x as long (`_events`).
STREAM_INTERVAL_S = 0.025


@dataclass(frozen=True)
class Reader:
    """How a streamed answer reads its rows' reports: the tokenizer; where the request asked
    for log-probs, the entries of a report's tokens (as the whole answer writes them); where
    gpt-oss's channels split a chat answer (`harmony.split_channels`), the prompt; and with
    `echo`, the prompts' texts (their log-prob entries come at the end: the engine scores a
    prompt once it is sampled)."""

    tok: Any
    answers: int  # how many choices the request has (its prompts x n)
    prompts: int  # how many prompts: each is sampled on its own, reporting its own progress
    entries: Callable[[NewTokens], list[TokenEntry]] | None = None
    channels: list[int] | None = None
    echoes: list[str] | None = None  # with `echo`: each choice's prompt text, sent first


# What a streamed answer hears as it is sampled: its reader, the prompts' length in tokens,
# the index of the choice the first row's tokens are of, and each row's new tokens.
Progress = Callable[[Reader, int, int, list[NewTokens]], None]
Update = tuple[Reader, int, int, list[NewTokens]]
Answer = tuple[list[Choice], int]  # the choices and the prompt's tokens


class Writer(Protocol):
    """A route's stream format."""

    def begin(self, prompt_tokens: int) -> list[str]:
        """The events before any text."""
        ...

    def pieces(self, pieces: Sequence[Piece]) -> str:
        """One event with more of some answers (text, log-prob entries); "" where the format
        has nothing to send of them."""
        ...

    def end(self, choices: Sequence[Choice], sent: Sequence[Sent], prompt_tokens: int) -> list[str]:  # fmt: skip
        """The rest of each answer (past ``sent``), its finish, the usage, the stream's end."""
        ...

    def error(self, status: int, detail: str) -> str:
        """The event that ends a stream that failed after it began."""
        ...

    def whole(self, choices: Sequence[Choice], prompt_tokens: int) -> list[str]:
        """A whole answer's events (one that finished before any progress came)."""
        ...


def sample_takes(backend: Any, name: str) -> bool:
    """Does the server's engine's ``sample`` take the keyword ``name``?"""
    return name in inspect.signature(backend.sample).parameters


def engine_streams(backend: Any) -> bool:
    """Does the server's engine report a sample's tokens as it decodes them?"""
    return sample_takes(backend, "progress")


async def live_stream(
    sample: Callable[[Progress], Awaitable[Answer]], req: OaiRequest, writer: Writer
) -> Response:
    """The reply streaming ``sample(progress)``'s answer to ``req`` as it is sampled, begun
    once every prompt's sample has reported (so that a prompt refused as its sample begins is
    an error reply); where the answer is done (or failed) by then (a request that only scores
    its prompts: `sample` does not pass ``progress`` on), the whole answer's events."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[Update] = asyncio.Queue()

    def progress(reader: Reader, prompt_tokens: int, first: int, rows: list[NewTokens]) -> None:
        loop.call_soon_threadsafe(updates.put_nowait, (reader, prompt_tokens, first, rows))

    task = asyncio.ensure_future(sample(progress))
    began: list[Update] = []  # the first reports, until every prompt's sample has begun
    waiting: asyncio.Future[Update] | None = None
    try:
        while not task.done():
            waiting = asyncio.ensure_future(updates.get())
            await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                break
            began.append(waiting.result())
            if len({first for _, _, first, _ in began}) == began[0][0].prompts:
                break
    except BaseException:  # the client left before the answer began
        task.cancel()
        if waiting is not None:
            waiting.cancel()
        raise
    if task.done():  # finished (or failed: an error reply) before every prompt began: whole
        if waiting is not None:
            waiting.cancel()
        choices, prompt_tokens = task.result()
        events = writer.whole(choices, prompt_tokens)
        return StreamingResponse(iter(events), media_type="text/event-stream")
    live = _events(req, writer, began, updates, task)
    return StreamingResponse(live, media_type="text/event-stream")


async def _events(
    req: OaiRequest,
    writer: Writer,
    pending: list[Update],
    updates: asyncio.Queue[Update],
    task: asyncio.Future[Answer],
) -> AsyncIterator[str]:
    """Each answer's settled text and its settled tokens' log-prob entries as its tokens come
    (the answers that moved, in one event per update), then the rest. Updates are paced: each
    event wakes the server and the client beside the decoding worker, so they come at most
    every `STREAM_INTERVAL_S` once the answer has run ten times that (every step before: the
    first words come at once), and each re-decodes the texts, so the next waits at least 4x as
    long as that took. ``pending``: the reports not taken yet (at first, those that came
    before the reply began)."""
    reader, prompt_tokens, _, _ = pending[0]
    sent = [Sent() for _ in range(reader.answers)]
    tokens: list[list[int]] = [[] for _ in range(reader.answers)]
    scored: list[list[TokenEntry]] = [[] for _ in range(reader.answers)]
    loop = asyncio.get_running_loop()
    started = loop.time()
    waiting: asyncio.Future[Any] | None = None
    try:
        for event in writer.begin(prompt_tokens):
            yield event
        while True:
            now = loop.time()
            for update in pending:
                _take(reader, update, tokens, scored)
            while not updates.empty():  # what came meanwhile, in order
                _take(reader, updates.get_nowait(), tokens, scored)
            pieces = [
                p
                for i in range(reader.answers)
                if (p := _piece(reader, req, i, tokens, scored, sent))
            ]
            if pieces and (event := writer.pieces(pieces)):
                yield event
            if task.done():
                break
            took, now = loop.time() - now, loop.time()
            pace = min(STREAM_INTERVAL_S, (now - started) / 10)
            await asyncio.wait([task], timeout=max(pace, 4 * took))
            waiting = asyncio.ensure_future(updates.get())
            await asyncio.wait([waiting, task], return_when=asyncio.FIRST_COMPLETED)
            pending = [waiting.result()] if waiting.done() else []
            waiting.cancel()  # (nothing if done)
        choices, prompt_tokens = task.result()
    except Exception as e:  # after the reply began: an error event ends the stream
        yield writer.error(*plain_error(e))
        return
    finally:
        task.cancel()  # the client went away: stop sampling (nothing if already done)
        if waiting is not None:  # its wait for the next update too ("Task was destroyed but
            waiting.cancel()  # it is pending", hunt)
    for event in writer.end(choices, sent, prompt_tokens):
        yield event


def _take(
    reader: Reader, update: Update, tokens: list[list[int]], scored: list[list[TokenEntry]]
) -> None:
    """A report's new tokens (and their entries, with log-probs asked for) onto each row's
    choice's."""
    _, _, first, rows = update
    for i, row in enumerate(rows, first):
        tokens[i] += row.tokens
        if reader.entries is not None:
            scored[i] += reader.entries(row)


def _piece(
    reader: Reader,
    req: OaiRequest,
    i: int,
    tokens: list[list[int]],
    scored: list[list[TokenEntry]],
    sent: list[Sent],
) -> Piece | None:
    """What answer ``i`` may send now past ``sent[i]`` (which it then counts as sent): its
    settled text (and reasoning: the channels' settled texts, where harmony splits it), and
    the entries of the tokens that text was read from while no stop string has come (each of
    those is then one the whole answer keeps). Not where a stop string holds U+FFFD: an incomplete
    character's text may hold it and a longer one's not, so which tokens the answer keeps is
    known at its end only."""
    text, stopped, read = settled_text(reader.tok, req, tokens[i])
    if reader.echoes is not None:
        text = reader.echoes[i] + text
    thought = ""
    if reader.channels is not None:  # gpt-oss: the answer is its channels' texts
        split = None if stopped else split_channels(reader.tok, reader.channels, tokens[i][:-1])
        text = "" if split is None else _settled(split[1], req.stop)[0]
        thought = "" if split is None or split[0] is None else _settled(split[0], req.stop)[0]
    done = sent[i]
    more, thought = unsent(text, done.text), unsent(thought, done.reasoning)
    live_scores = not stopped and not any("\ufffd" in s for s in req.stop) and not req.echo
    new = scored[i][len(done.tokens) : read] if live_scores else []
    if not more and not new and not thought:
        return None
    piece = Piece(i, more, new, done.offset, thought)
    done.text += more
    done.tokens += new
    done.reasoning += thought
    return piece


def settled_text(tok: Any, req: OaiRequest, tokens: list[int]) -> tuple[str, bool, int]:
    """The part of an answer's text so far that later tokens cannot change, whether a stop
    string has come, and how many of ``tokens`` it read: not the last (a merge or a
    character's bytes may still complete it), nor, while the last continues a run of
    byte-fallback pieces, that run (a later piece may turn it into U+FFFDs); then as
    `_settled`."""
    end, facts = len(tokens) - 1, byte_fallback(tok)
    if facts is not None and tokens:
        skipped = facts.specials if req.skip_special_tokens else frozenset()

        def joins(t: int) -> bool:  # to a run of byte pieces (`ByteFallback`)
            return t in facts.pieces or t in skipped or t >= facts.size

        if joins(tokens[-1]):  # a run still open: a later piece may turn it to U+FFFDs
            while end > 0 and joins(tokens[end - 1]):
                end -= 1
    decoded = decode_answer(tok, tokens[:end], req.skip_special_tokens)
    return (*_settled(decoded, req.stop), end)


def _settled(decoded: str, stops: list[str]) -> tuple[str, bool]:
    """The part of ``decoded`` (an answer's text without its last token) that later tokens
    cannot change, and whether a stop string has come: up to a stop string, without an
    incomplete character (U+FFFD at the end, which a stop string is not looked for in) or a
    tail that may begin a stop string."""
    text, stop = cut_at_stop(decoded.rstrip("\ufffd"), stops)
    if stop is None:
        text = text[: len(text) - max((_held_back(text, s) for s in stops), default=0)]
    return text, stop is not None


def _held_back(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that begins ``stop`` (and is shorter than
    it): only the places in ``text``'s last ``len(stop) - 1`` characters where ``stop``'s
    first character is are tried. Before, every prefix of every stop string was, on the
    event loop at each streamed step: sixteen 300,000-character stop strings held the
    server for tens of seconds (a hunt)."""
    at = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while at >= 0:
        if stop.startswith(text[at:]):
            return len(text) - at
        at = text.find(stop[0], at + 1)
    return 0
