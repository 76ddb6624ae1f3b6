"""A server resolves the Hub names its clients send (``Org/Name@revision``) in its local
Hugging Face cache, and nowhere else: no part of a name may lead out of the cache, and a ref
file is read as a commit name, never as a path or as a file to echo back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinker_sr.engine.registry import ModelRegistry
from tinker_sr.hf_files import cached_hub_model
from tinker_sr.testing.hf_model_dir import make_tiny_hf_model_dir
from tinker_sr.user_errors import EngineUserError

SHA = "c" * 40


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache with one model, tiny-org/tiny, and, outside the cache, a model directory the
    operator never offered."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--tiny-org--tiny"
    make_tiny_hf_model_dir(repo / "snapshots" / SHA, n_layers=1)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    make_tiny_hf_model_dir(tmp_path / "secret", n_layers=1)
    return repo


def test_cached_names_resolve(hub: Path) -> None:
    snap = hub / "snapshots" / SHA
    for name in ("tiny-org/tiny", "tiny-org/tiny@main", f"tiny-org/tiny@{SHA}"):
        assert cached_hub_model(name) == snap.absolute(), name
    registry = ModelRegistry({}, request_paths=False)  # as `tinker-sr serve` runs it
    assert registry.resolve_model("tiny-org/tiny") == str(snap.absolute())
    # branches and tags as huggingface_hub stores them: nested (a PR's ref) and dotted
    other = "d" * 40
    make_tiny_hf_model_dir(hub / "snapshots" / other, n_layers=1)
    (hub / "refs" / "refs" / "pr").mkdir(parents=True)
    (hub / "refs" / "refs" / "pr" / "1").write_text(other)
    (hub / "refs" / "v1.0").write_text(other)
    for name in ("tiny-org/tiny@refs/pr/1", "tiny-org/tiny@v1.0", f"tiny-org/tiny@{other}"):
        assert cached_hub_model(name) == (hub / "snapshots" / other).absolute(), name


def test_no_name_leads_out_of_the_cache(hub: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    names = [
        str(secret),  # a path as the name: never resolved for a request
        f"tiny-org/tiny@{secret}",  # an absolute revision replaced the whole path
        "tiny-org/tiny@../../../secret",  # a relative one climbed out of snapshots/
        "tiny-org/tiny@refs/../../../../secret",
        "../hub/tiny@x",
        "tiny-org/..@main",
    ]
    registry = ModelRegistry({}, request_paths=False)
    for name in names:
        assert cached_hub_model(name) is None, name
        with pytest.raises(EngineUserError, match="is not available on this server"):
            registry.resolve_model(name)


def test_a_ref_file_is_read_as_a_commit_name_only(hub: Path, tmp_path: Path) -> None:
    registry = ModelRegistry({}, request_paths=False)
    secret_text = "root:*:20228:0:99999:7:::" + "x" * 300  # a long line, as /etc/shadow's
    for content in (str(tmp_path / "secret"), "../../../secret", secret_text, "\xff\xfe"):
        (hub / "refs" / "main").write_bytes(content.encode("utf-8", "surrogateescape"))
        with pytest.raises(EngineUserError) as e:  # was a 500 echoing the file's content
            registry.resolve_model("tiny-org/tiny")
        assert "is not available on this server" in str(e.value)
        assert "root:" not in str(e.value)
    (hub / "refs" / "main").write_bytes(b"c" * (1 << 20))  # read with a cap, not whole
    assert cached_hub_model("tiny-org/tiny") is None
