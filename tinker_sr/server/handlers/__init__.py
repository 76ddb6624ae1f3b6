"""Endpoint handlers: each decodes its body with `tinker_sr.wire`, checks ownership, calls the
backend and encodes the answer. Every handler is ``async (server, request, owner) ->
Response``; `TinkerServer.routes` binds them to their paths."""
