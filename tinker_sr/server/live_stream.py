"""Answers streamed while the engine samples them, for the OpenAI- and Anthropic-compatible
routes (`handlers.oai`, `handlers.anthropic`).

The sampling worker tells a request's listener its rows' new tokens after the prefill and each
decode step (`engine.scheduler`, `LocalBackend.sample(..., progress=...)`); here each answer's
settled text (what later tokens cannot change) goes out as it grows, in the route's own event
format (a `Writer`), and the whole answer's remainder, finish and usage at the end, so the
pieces join to the very text the unstreamed answer has. The reply begins once the request is
decoding: whatever fails before that (the prompt, the model, the server's load) is an error
reply as for any request; what fails later ends the stream with an error event. A client that
goes away cancels its sample.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from starlette.responses import Response, StreamingResponse

from .http import plain_error
from .oai_format import Choice, OaiRequest, cut_at_stop

# A streamed answer's events, at most this often once it has run 10x as long (`_events`).
STREAM_INTERVAL_S = 0.025
# What a streamed answer hears as it is sampled: the tokenizer, the prompt's length in
# tokens, and each row's new tokens.
Progress = Callable[[Any, int, list[list[int]]], None]
Answer = tuple[list[Choice], int]  # the choices and the prompt's tokens


class Writer(Protocol):
    """A route's stream format."""

    def begin(self, prompt_tokens: int) -> list[str]:
        """The events before any text."""
        ...

    def pieces(self, pieces: Sequence[tuple[int, str]]) -> str:
        """One event with more text of some answers, ``(index, text)`` each."""
        ...

    def end(self, choices: Sequence[Choice], sent: Sequence[str], prompt_tokens: int) -> list[str]:  # fmt: skip
        """The rest of each answer (past ``sent``), its finish, the usage, the stream's end."""
        ...

    def error(self, status: int, detail: str) -> str:
        """The event that ends a stream that failed after it began."""
        ...

    def whole(self, choices: Sequence[Choice], prompt_tokens: int) -> list[str]:
        """A whole answer's events (one that finished before any progress came)."""
        ...


def engine_streams(backend: Any) -> bool:
    """Does the server's engine report a sample's tokens as it decodes them?"""
    return "progress" in inspect.signature(backend.sample).parameters


async def live_stream(
    sample: Callable[[Progress], Awaitable[Answer]], req: OaiRequest, writer: Writer
) -> Response:
    """The reply streaming ``sample(progress)``'s answer to ``req`` as it is sampled; where no
    progress comes before it finishes (several prompts, log-probs or echo, harmony's
    channels: `sample` does not pass it on), the whole answer's events."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[tuple[Any, int, list[list[int]]]] = asyncio.Queue()

    def progress(tok: Any, prompt_tokens: int, rows: list[list[int]]) -> None:  # on the worker
        loop.call_soon_threadsafe(updates.put_nowait, (tok, prompt_tokens, rows))

    task = asyncio.ensure_future(sample(progress))
    first = asyncio.ensure_future(updates.get())
    try:
        await asyncio.wait([task, first], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the client left before the answer began
        task.cancel()
        first.cancel()
        raise
    if not first.done():  # finished (or failed) before any progress: as a whole
        first.cancel()
        choices, prompt_tokens = task.result()
        events = writer.whole(choices, prompt_tokens)
        return StreamingResponse(iter(events), media_type="text/event-stream")
    live = _events(req, writer, first.result(), updates, task)
    return StreamingResponse(live, media_type="text/event-stream")


async def _events(
    req: OaiRequest,
    writer: Writer,
    update: tuple[Any, int, list[list[int]]],
    updates: asyncio.Queue[tuple[Any, int, list[list[int]]]],
    task: asyncio.Future[Answer],
) -> AsyncIterator[str]:
    """Each answer's settled text as its tokens come (the answers that moved, in one event per
    update), then the rest. Updates are paced: each event wakes the server and the client
    beside the decoding worker, so they come at most every `STREAM_INTERVAL_S` once the answer
    has run ten times that (every step before: the first words come at once), and each
    re-decodes the texts, so the next waits at least 4x as long as that took."""
    tok, prompt_tokens, _ = update
    sent = [""] * req.n
    tokens: list[list[int]] = [[] for _ in range(req.n)]
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        for event in writer.begin(prompt_tokens):
            yield event
        while True:
            began = loop.time()
            for i, more in enumerate(update[2]):
                tokens[i] += more
            while not updates.empty():  # what came meanwhile, in order
                for i, more in enumerate(updates.get_nowait()[2]):
                    tokens[i] += more
            pieces = []
            for i, row in enumerate(tokens):
                text = settled_text(tok, req, row)
                if len(text) > len(sent[i]) and text.startswith(sent[i]):
                    pieces.append((i, text[len(sent[i]) :]))
                    sent[i] = text
            if pieces:
                yield writer.pieces(pieces)
            if task.done():
                break
            now = loop.time()
            pace = min(STREAM_INTERVAL_S, (now - started) / 10)
            await asyncio.wait([task], timeout=max(pace, 4 * (now - began)))
            waiting: asyncio.Future[Any] = asyncio.ensure_future(updates.get())
            await asyncio.wait([waiting, task], return_when=asyncio.FIRST_COMPLETED)
            if waiting.done():
                update = waiting.result()
            else:
                waiting.cancel()
                update = (tok, prompt_tokens, [])
        choices, prompt_tokens = task.result()
    except Exception as e:  # after the reply began: an error event ends the stream
        yield writer.error(*plain_error(e))
        return
    finally:
        task.cancel()  # the client went away: stop sampling (nothing if already done)
    for event in writer.end(choices, sent, prompt_tokens):
        yield event


def settled_text(tok: Any, req: OaiRequest, tokens: list[int]) -> str:
    """The part of an answer's text so far that later tokens cannot change: up to a stop
    string, without its last token (a merge or a character's bytes may still complete it),
    a tail that may begin a stop string, or an incomplete character."""
    decoded = str(tok.decode(tokens[:-1], skip_special_tokens=req.skip_special_tokens))
    text, stop = cut_at_stop(decoded, req.stop)
    if stop is None:
        tail = [k for s in req.stop for k in range(1, len(s)) if text.endswith(s[:k])]
        text = text[: len(text) - max(tail, default=0)]
    return text.rstrip("\ufffd")
