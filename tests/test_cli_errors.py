"""What users type wrong at the command line gets one line and an exit code, not a traceback;
Ctrl-C stops cleanly; and what a command prints is what it did. Each case failed before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import tinker_sr as tinker
from tests._server import free_port
from tinker_sr import cli
from tinker_sr.engine.store import Store

DEMO = ["demo", "--steps", "2", "--group-size", "2", "--quiet", "--no-plot"]


def _interrupted(argv: list[str], ready: Callable[[], bool], tmp_path: Path) -> tuple[int, str]:
    """Run ``tinker-sr argv`` until ``ready()``, Ctrl-C it, and return (exit code, output)."""
    log = tmp_path / "output.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tinker_sr", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            # A shell's background job ignores SIGINT; a user's terminal does not.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + 120
            while not ready() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert proc.poll() is None, log.read_text()
            proc.send_signal(signal.SIGINT)
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    return code, log.read_text()


def test_ctrl_c_stops_serve_in_one_line(tmp_path: Path) -> None:
    """Before: ~40 lines of CancelledError / KeyboardInterrupt traceback after the shutdown."""
    port = free_port()
    log = tmp_path / "output.txt"
    argv = ["serve", "--port", str(port), "--store", str(tmp_path / "store")]
    code, text = _interrupted(
        argv, lambda: log.exists() and "startup complete" in log.read_text(), tmp_path
    )
    assert code == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert text.rstrip().endswith("tinker-sr serve: interrupted"), text


def test_ctrl_c_stops_demo_keeping_whole_lines(tmp_path: Path) -> None:
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    argv = ["demo", "--steps", "500", "--quiet", "--no-plot", "--out", str(out)]
    code, text = _interrupted(
        argv, lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, tmp_path
    )
    assert code == 130, text
    assert "Traceback" not in text, text
    lines = metrics.read_text().splitlines()
    assert lines and all(json.loads(line)["step"] == i for i, line in enumerate(lines))


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--staleness", "0", "--stress", "stale"], "--staleness must be >= 1"),
        (["--group-size", "0"], "--group-size must be >= 1"),
    ],
)
def test_bad_demo_numbers_are_one_line_and_keep_the_previous_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    """Before: a traceback (staleness 0), or the service's refusal after metrics.jsonl of the
    previous run in --out had been emptied (group size 0)."""
    previous = '{"step": 0}\n'
    (tmp_path / "metrics.jsonl").write_text(previous)
    assert cli.main([*DEMO, "--out", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert (tmp_path / "metrics.jsonl").read_text() == previous


def test_a_new_demo_run_replaces_the_previous_runs_files(tmp_path: Path) -> None:
    """Before: a rerun with --no-plot left the previous run's plot beside the new metrics."""
    (tmp_path / "learning_curves.png").write_bytes(b"old plot")
    assert cli.main([*DEMO, "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "learning_curves.png").exists()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 2


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_demo_out_that_cannot_be_written_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    (tmp_path / "f").write_text("")
    out = tmp_path / "f" if kind == "a file" else tmp_path / "f" / "sub"
    assert cli.main([*DEMO, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: cannot write there" in err and "Traceback" not in err


def test_demo_window_label_says_how_many_steps_it_averaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "mean of the first / last 5 steps" for a 2-step run (one step each)."""
    assert cli.main([*DEMO, "--out", str(tmp_path)]) == 0
    assert "(mean of the first / last step)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("variable", "value", "needle"),
    [
        ("TINKER_SR_MODEL_ALIASES", "garbage", "$TINKER_SR_MODEL_ALIASES entry 'garbage'"),
        ("TINKER_SR_MODEL_DTYPE", "bogus", "$TINKER_SR_MODEL_DTYPE: 'bogus'"),
    ],
)
def test_bad_engine_environment_is_one_line_from_demo_and_serve(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    value: str,
    needle: str,
) -> None:
    monkeypatch.setenv(variable, value)
    assert cli.main([*DEMO, "--out", str(tmp_path / "run")]) == 2
    assert needle in capsys.readouterr().err
    with pytest.raises(SystemExit, match=f"tinker-sr serve: {needle}".replace("$", r"\$")):
        cli.main(["serve", "--port", str(free_port()), "--store", str(tmp_path / "store")])


def test_serve_refuses_an_alias_in_the_environment_it_cannot_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the --model-alias flag is: before, the server started and failed at first use."""
    monkeypatch.setenv("TINKER_SR_MODEL_ALIASES", f"x={tmp_path / 'nowhere'}")
    with pytest.raises(SystemExit, match=r"\$TINKER_SR_MODEL_ALIASES x=.*no config.json"):
        cli.main(["serve", "--port", str(free_port()), "--store", str(tmp_path / "store")])
    with pytest.raises(SystemExit, match="--model-alias entry 'garbage'"):
        cli.main(["serve", "--model-alias", "garbage", "--store", str(tmp_path / "store")])


@pytest.mark.parametrize("flags", [["--api-key", ""], ["--api-keys", ","]])
def test_serve_with_an_empty_key_refuses_instead_of_accepting_any(
    tmp_path: Path, flags: list[str]
) -> None:
    """`--api-key "$UNSET"` started a server open to every 'tml-' key."""
    with pytest.raises(SystemExit, match="name no key"):
        cli.main(["serve", *flags, "--store", str(tmp_path / "store")])


@pytest.mark.parametrize("url", ["127.0.0.1:8000", " http://127.0.0.1:8000"])
def test_a_base_url_without_its_scheme_is_named(url: str) -> None:
    """Before: a minute of retries, then "Connection error." (httpx: unsupported protocol)."""
    with pytest.raises(tinker.TinkerError, match="must start with http:// or https://"):
        tinker.ServiceClient(base_url=url, api_key="tml-x")


def test_usage_of_a_damaged_store_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "engine.sqlite").write_text("not a database")
    assert cli.main(["usage", "--store", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a readable tinker_sr store" in err and "Traceback" not in err


def test_a_read_only_store_reads_and_refuses_writes(tmp_path: Path) -> None:
    """What `usage` and `export` open (also on a read-only file system): every write refused,
    the database's bytes as they were."""
    import sqlite3

    db = tmp_path / "engine.sqlite"
    Store(db).close()
    before = db.read_bytes()
    store = Store(db, read_only=True)
    try:
        assert store.usage_rows(0, time.time()) == []
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            store.add_session("s", user_metadata=None, project_id=None, display_name=None)
    finally:
        store.close()
    assert db.read_bytes() == before


def test_plot_out_names_the_file_it_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "wrote curves" for curves.png, and a directory got "DIR.png" beside it."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "loss": {i}}}\n' for i in range(3)))
    assert cli.main(["plot", str(run), "--out", str(tmp_path / "curves")]) == 0
    assert f"wrote {tmp_path / 'curves.png'}" in capsys.readouterr().out
    assert (tmp_path / "curves.png").is_file()
    folder = tmp_path / "plots"
    folder.mkdir()
    assert cli.main(["plot", str(run), "--out", str(folder)]) == 0
    written = capsys.readouterr().out.strip().splitlines()[-1].removeprefix("wrote ")
    assert Path(written).parent == folder and Path(written).is_file()


def test_run_takes_a_directory_with_main_as_python_does(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("WHO = 'helper'\n")
    (app / "__main__.py").write_text("import helper, tinker\nprint(helper.WHO, tinker.__name__)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tinker_sr", "run", str(app)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["helper", "tinker_sr"]  # tinker resolves to tinker_sr


def test_export_of_a_directory_and_a_failed_export_leave_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "checkpoint file not found" for a directory; a failed export left the new
    parents of OUT behind (docs/models.md: "a failed export leaves OUT as it was")."""
    assert cli.main(["export", str(tmp_path), str(tmp_path / "o1")]) == 2
    assert "is a directory; pass a checkpoint" in capsys.readouterr().err
    nested = tmp_path / "a" / "b" / "c"
    path = "tinker://run/sampler_weights/x"
    assert cli.main(["export", path, str(nested), "--store", str(tmp_path / "nostore")]) == 2
    assert not (tmp_path / "a").exists()


def test_version_is_printed() -> None:
    """``tinker-sr --version`` answered "the following arguments are required: command"."""
    from importlib.metadata import version

    import tinker_sr

    done = subprocess.run(
        [sys.executable, "-m", "tinker_sr", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"tinker-sr {tinker_sr.__version__}"
    assert tinker_sr.__version__ == version("tinker-sr")  # the package's metadata agrees


def test_paths_as_users_write_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found with odd paths: a quoted ``~`` store (.env files, unit files) made a literal
    ``./~`` directory; a ``--model-alias`` target with a comma was cut at it; and a relative
    store turned every "." (or every word "store") of an internal error into ``<store>``."""
    from tinker_sr.backend.local import LocalBackend
    from tinker_sr.backend.local_errors import hide_paths
    from tinker_sr.cli import _alias_flags
    from tinker_sr.engine.store import default_store_dir

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TINKER_SR_STORE", "~/stores/a")
    assert default_store_dir() == home / "stores" / "a"
    backend = LocalBackend("~/stores/b")
    try:
        assert backend.store_dir == home / "stores" / "b" and backend.store_dir.is_dir()
    finally:
        backend.close()
    assert not (cwd / "~").exists()

    assert _alias_flags(["m1=/models/a,b", "x=tinker-sr/tiny,y=tinker-sr/small"]) == {
        "m1": "/models/a,b",
        "x": "tinker-sr/tiny",
        "y": "tinker-sr/small",
    }
    text = "cannot read '/data/run.1/s1.safetensors' (v1.2)"
    assert hide_paths(OSError(text), Path(".")) == text
    assert hide_paths(OSError(f"{cwd}/x missing"), Path(".")) == "<store>/x missing"


def test_the_command_line_is_parsed_without_loading_torch() -> None:
    """Every command's parser is built for any command (``tinker-sr --version`` too), and the
    ``serve`` parser's defaults came from `tinker_sr.server.app`, which loaded torch and the
    whole server: 5 s for ``--version`` on a slow host, 1.5 s now."""
    code = (
        "import sys\n"
        "from tinker_sr import cli\n"
        "parser = cli.build_parser()\n"
        "for command in (['serve', '--port', '9'], ['usage'], ['plot', 'x.jsonl'], ['demo']):\n"
        "    parser.parse_args(command)\n"
        "import tinker_sr.server\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n"
        "assert 'tinker_sr.server.app' not in sys.modules\n"
        "assert tinker_sr.server.DEFAULT_LONG_POLL_S > 0\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
