"""Signed download URLs for the files of external-weights checkpoints.

``RestClient.get_external_weights_urls`` answers one URL per file, to be fetched with a plain
HTTP GET and no API key (``urllib.request.urlretrieve``, as tinker-cookbook and ``tinker
checkpoint download`` do). A URL names the checkpoint and the file and carries its expiry and
an HMAC-SHA256, under the server's signing key, of those and of the checkpoint's creation time,
so it grants exactly that file of that export until then:
``/api/v1/external_weights_files/<run_id>/<name>/<file>?expires=<unix s>&sig=<hex>``.

The key lives in ``<store>/url_signing.key`` (created with mode 0600), so URLs survive a server
restart; without a store it is per process. Delete the file to revoke every URL at once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import secrets
import time
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

from tinker_sr.validation import EXTERNAL_URL_TTL_S

from .http import HTTPError

ROUTE = "/api/v1/external_weights_files"
KEY_FILE = "url_signing.key"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _is_digits(text: str | None, max_len: int) -> bool:
    return text is not None and 0 < len(text) <= max_len and text.isascii() and text.isdigit()


def load_key(store_dir: Path | None) -> bytes:
    """The signing key of the server whose state is in `store_dir` (made on first use)."""
    if store_dir is None:
        return secrets.token_bytes(32)
    path = store_dir / KEY_FILE
    try:
        key = path.read_bytes()
        if len(key) == 32:
            return key
    except FileNotFoundError:
        pass
    store_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return key


class UrlSigner:
    def __init__(self, key: bytes, ttl_s: float = EXTERNAL_URL_TTL_S) -> None:
        self._key = key
        self.ttl_s = ttl_s

    def _mac(self, run_id: str, name: str, version: str, file: str, expires: int) -> str:
        message = json.dumps([run_id, name, version, file, expires]).encode()  # unambiguous
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def sign(
        self,
        base_url: str,
        run_id: str,
        name: str,
        version: str,
        files: list[str],
        now: float | None = None,
    ) -> tuple[dict[str, str], datetime]:
        """One URL per file of checkpoint ``tinker://<run_id>/external_weights/<name>``, under
        `base_url` (scheme and host the client reached this server at), and their expiry.
        `version` (the checkpoint's creation time) ties them to this export: a later one saved
        under the same name is not readable with them."""
        expires = math.ceil((time.time() if now is None else now) + self.ttl_s)
        root = f"{base_url.rstrip('/')}{ROUTE}/{quote(run_id, safe='')}/{quote(name, safe='')}"
        urls = {
            file: f"{root}/{quote(file, safe='')}?expires={expires}"
            f"&sig={self._mac(run_id, name, version, file, expires)}"
            for file in files
        }
        return urls, datetime.fromtimestamp(expires, tz=UTC)

    def check(
        self,
        run_id: str,
        name: str,
        version: str,
        file: str,
        expires: str | None,
        sig: str | None,
        now: float | None = None,
    ) -> None:
        """Accept a URL this server signed for this version of the checkpoint and that has not
        expired; 403 otherwise."""
        renew = "ask for new URLs with RestClient.get_external_weights_urls"
        if not (_is_digits(expires, 15) and sig is not None and _HEX64.fullmatch(sig)):
            raise HTTPError(403, f"download URL is not signed (expires and sig); {renew}")
        assert expires is not None
        good = self._mac(run_id, name, version, file, int(expires))
        if not hmac.compare_digest(good.encode(), sig.encode()):
            raise HTTPError(
                403,
                "download URL signature does not match (altered, for an export since deleted or "
                "saved again under this name, or signed with a key this server no longer has); "
                f"{renew}",
            )
        if int(expires) <= (time.time() if now is None else now):
            stamp = datetime.fromtimestamp(int(expires), tz=UTC).isoformat()
            raise HTTPError(403, f"download URL expired at {stamp}; {renew}")
