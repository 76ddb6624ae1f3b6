"""`tinker-sr plot` draws learning curves from real metrics.jsonl files (the demo's and the
cookbook logger's), prints a text summary without matplotlib, and answers bad input with one
line on stderr and exit code 2."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tinker_sr import cli, demo, plot

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_plot(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    rc = cli.main(["plot", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5_000, path
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width > 100 and height > 100


def assert_one_line_error(rc: int, err: str, *parts: str) -> None:
    assert rc == 2
    assert err.startswith("tinker-sr plot: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for part in parts:
        assert part in err, err


def write_jsonl(path: Path, rows: list[Any], tail: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def rows(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"step": i, "reward": 0.1 * i, "loss": 1.0 / (i + 1), **extra} for i in range(n)]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `tinker-sr demo` run directory (metrics.jsonl, config.json)."""
    out = tmp_path_factory.mktemp("demo") / "sr-run"
    argv = ["demo", "--steps", "3", "--group-size", "4", "--out", str(out), "--quiet", "--no-plot"]
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def cookbook_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log_path written by tinker-cookbook's own logger, as its RL recipes write it: a NaN,
    keys that come and go, and a step-less summary row."""
    ml_log = pytest.importorskip("tinker_cookbook.utils.ml_log")
    log_dir = tmp_path_factory.mktemp("cookbook") / "rl-run"
    logger = ml_log.setup_logging(
        log_dir=str(log_dir), wandb_project=None, do_configure_logging_module=False
    )
    logger.log_hparams({"learning_rate": 1e-4})
    for step in range(12):
        metrics: dict[str, Any] = {
            "env/all/reward/total": 0.1 + 0.05 * step,
            "optim/lr": 1e-4,
            "optim/kl_sample_train_v1": 0.001 * step,
            "optim/entropy": math.nan if step == 4 else 2.0 - 0.01 * step,
            "progress/done_frac": (step + 1) / 12,
            "time/total": 1.5,
        }
        if step % 4 == 0:
            metrics["test/env/all/reward/total"] = 0.1 + 0.04 * step
        logger.log_metrics(metrics, step=step)
    logger.log_summary({"tokens/cumulative": 12345})
    logger.close()
    return log_dir


# ---- real runs ------------------------------------------------------------------------------


def test_a_demo_run_plots_beside_itself(demo_run: Path, capsys) -> None:
    rc, out, err = run_plot(capsys, demo_run)
    assert rc == 0, err
    assert f"sr-run: 3 steps (0 to 2) from {demo_run / 'metrics.jsonl'}" in out
    assert "keys: reward, loss, kl_sampler_learner, entropy (the default pick" in out
    assert f"wrote {demo_run / 'curves.png'}" in out
    assert_png(demo_run / "curves.png")


def test_the_demo_draws_through_the_same_routine() -> None:
    assert demo.plot_curves is plot.plot_curves
    assert [p.key for p in demo.DEMO_PANELS] == ["reward", "kl_k3", "entropy", "grad_norm"]


def test_list_shows_the_numeric_keys_with_count_and_last_value(demo_run: Path, capsys) -> None:
    rc, out, _ = run_plot(capsys, demo_run / "metrics.jsonl", "--list")
    assert rc == 0
    last = json.loads((demo_run / "metrics.jsonl").read_text().splitlines()[-1])
    lines = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert lines["reward"] == ["reward", "3", plot.fmt(last["reward"])]
    assert {"step", "loss", "kl_k3", "entropy", "grad_norm", "tokens_per_s"} <= lines.keys()
    # Dicts and strings are not curves.
    assert "reward_by_prompt" not in lines and "example" not in lines
    assert not (demo_run / "list.png").exists()


def test_a_cookbook_log_path_plots(cookbook_run: Path, tmp_path: Path, capsys) -> None:
    rc, out, err = run_plot(capsys, cookbook_run, "--out", tmp_path / "cb.png")
    assert rc == 0, err
    assert "rl-run: 12 steps (0 to 11)" in out
    assert "1 line without a numeric 'step' left out" in out  # log_summary's row
    keys = (
        "env/all/reward/total, test/env/all/reward/total, optim/kl_sample_train_v1, optim/entropy"
    )
    assert f"keys: {keys} (" in out
    assert_png(tmp_path / "cb.png")
    rc, out, _ = run_plot(capsys, cookbook_run, "--list")
    assert rc == 0
    assert "12 records" not in out and "13 records" in out
    stats = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    assert stats["optim/entropy"] == ["11", "1.89"]  # the NaN is a gap, not a value
    assert stats["test/env/all/reward/total"][0] == "3"
    assert stats["tokens/cumulative"] == ["1", "1.234e+04"]


def test_several_runs_overlay_labelled_by_directory(
    demo_run: Path, cookbook_run: Path, tmp_path: Path, capsys
) -> None:
    a = write_jsonl(tmp_path / "a" / "run" / "metrics.jsonl", rows(5))
    b = write_jsonl(tmp_path / "b" / "run" / "metrics.jsonl", rows(7))
    out_png = tmp_path / "new" / "dir" / "all.png"
    rc, out, err = run_plot(capsys, a, b.parent, demo_run, cookbook_run, "--out", out_png)
    assert rc == 0, err
    for label in ("a/run: 5 steps", "b/run: 7 steps", "sr-run: 3 steps", "rl-run: 12 steps"):
        assert label in out
    assert f"wrote {out_png}" in out
    assert_png(out_png)


def test_a_directory_of_runs_plots_each(tmp_path: Path, capsys) -> None:
    for name, n in (("seed0", 4), ("seed1", 6)):
        write_jsonl(tmp_path / "sweep" / name / "metrics.jsonl", rows(n))
    (tmp_path / "sweep" / "notes").mkdir()
    rc, out, _ = run_plot(capsys, tmp_path / "sweep", "--smooth", "3", "--keys", "reward")
    assert rc == 0
    assert "seed0: 4 steps" in out and "seed1: 6 steps" in out and "keys: reward (--keys)" in out
    assert_png(tmp_path / "sweep" / "curves.png")


def test_keys_and_x_options(cookbook_run: Path, tmp_path: Path, capsys) -> None:
    png = tmp_path / "x.png"
    argv = [cookbook_run, "--keys", "optim/lr,time/total", "--keys", "optim/lr"]
    rc, out, err = run_plot(capsys, *argv, "--x", "progress/done_frac", "--out", png)
    assert rc == 0, err
    assert "keys: optim/lr, time/total (--keys)" in out
    assert "12 records with progress/done_frac (0.08333 to 1)" in out
    assert_png(png)
    rc, out, _ = run_plot(capsys, cookbook_run, "--x", "index", "--out", png)
    assert rc == 0 and "rl-run: 13 records from" in out


def test_a_file_without_step_uses_the_record_number(tmp_path: Path, capsys) -> None:
    f = write_jsonl(tmp_path / "losses.jsonl", [{"train_mean_nll": 3.0 - i / 10} for i in range(8)])
    rc, out, _ = run_plot(capsys, f)
    assert rc == 0
    assert (
        "losses: 8 records from" in out and "no numeric 'step' key: x is the record number" in out
    )
    assert "keys: train_mean_nll (the default pick: loss metrics" in out
    assert_png(tmp_path / "curves.png")


def test_mixed_values_are_read_as_far_as_they_are_numbers(tmp_path: Path, capsys) -> None:
    f = tmp_path / "metrics.jsonl"
    f.write_text(
        '{"step": 0, "acc": 0.5, "flag": true, "name": "x", "nested": {"a": 1}}\n'
        '{"step": 1, "acc": NaN, "note": null}\n'
        "\n"
        '{"step": 2, "acc": Infinity, "big": 1' + "0" * 400 + "}\n"
        '{"step": "three", "acc": 0.7}\n'
        '{"step": 4, "acc": 0.9}\n'
    )
    rc, out, _ = run_plot(capsys, f, "--list")
    assert rc == 0
    stats = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    assert stats == {"step": ["4", "4"], "acc": ["3", "0.9"], "big": ["0", "nan"]}
    rc, out, _ = run_plot(capsys, f)  # no reward/loss/KL/entropy key: the first numeric ones
    assert rc == 0 and "keys: acc, big (no reward, loss, KL or entropy key" in out
    assert "4 steps (0 to 4)" in out and "1 line without a numeric 'step' left out" in out


# ---- without matplotlib -----------------------------------------------------------------------


def test_without_matplotlib_a_text_summary(
    demo_run: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    f = write_jsonl(tmp_path / "run" / "metrics.jsonl", rows(30))
    rc, out, err = run_plot(capsys, f, demo_run, "--smooth", "2")
    assert rc == 0 and err == ""
    assert "no PNG: matplotlib is not available" in out and "pip install 'tinker-sr[plot]'" in out
    assert not (tmp_path / "run" / "curves.png").exists() and "wrote" not in out
    lines = out.splitlines()
    reward = lines[lines.index("reward") + 1]
    assert reward.startswith("  run ") and "30 values  first 0  last 2.9  min 0  max 2.9" in reward
    assert reward.endswith(plot.sparkline(plot.moving_average([0.1 * i for i in range(30)], 2)))
    assert reward[-1] == "█" and "▁" in reward
    assert any(line.startswith("  sr-run") and "3 values" in line for line in lines)


def test_sparkline_and_moving_average() -> None:
    assert plot.sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert plot.sparkline([1.0, 1.0]) == "▄▄"
    assert plot.sparkline([0, math.nan, 1]) == "▁ █"
    assert plot.sparkline([math.nan]) == "" and plot.sparkline([]) == ""
    assert len(plot.sparkline(list(range(1000)))) == plot.SPARK_WIDTH
    assert plot.moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    assert plot.moving_average([1, math.nan, 3], 2) == [1, 1, 3]
    # An outlier leaves the window exactly (no running-sum residue).
    assert plot.moving_average([1e20, 1.0, 2.0, 3.0], 2)[-1] == 2.5


# ---- hostile input: one line on stderr, exit code 2 ------------------------------------------------


def test_a_missing_path(tmp_path: Path, capsys) -> None:
    rc, out, err = run_plot(capsys, tmp_path / "nope")
    assert_one_line_error(rc, err, f"{tmp_path / 'nope'}: no such file or directory")
    assert out == ""


def test_a_directory_without_metrics(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty-run" / "sub").mkdir(parents=True)
    rc, _, err = run_plot(capsys, tmp_path / "empty-run")
    assert_one_line_error(rc, err, "no metrics.jsonl in this directory or its subdirectories")


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_empty_file(tmp_path: Path, capsys, text: str) -> None:
    (tmp_path / "metrics.jsonl").write_text(text)
    rc, _, err = run_plot(capsys, tmp_path)
    assert_one_line_error(rc, err, "metrics.jsonl: empty, no metrics to plot")


def test_a_truncated_last_line_is_skipped_with_a_note(tmp_path: Path, capsys) -> None:
    """A run still being written: its last line has no newline yet."""
    write_jsonl(tmp_path / "live" / "metrics.jsonl", rows(4), tail='{"step": 4, "rew')
    rc, out, err = run_plot(capsys, tmp_path / "live")
    assert rc == 0, err
    assert "live: 4 steps (0 to 3)" in out
    assert "skipped the unfinished last line 5 (still being written?)" in out
    assert_png(tmp_path / "live" / "curves.png")
    only = write_jsonl(tmp_path / "starting" / "metrics.jsonl", [], tail='{"step": 0')
    rc, _, err = run_plot(capsys, only)
    assert_one_line_error(rc, err, "no complete line yet, no metrics to plot")


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("not json at all", "metrics.jsonl:3: not JSON (Expecting value): 'not json at all'"),
        ('{"step": 2, "reward": 0.5', "metrics.jsonl:3: not JSON"),  # cut, then more lines
        ("[1, 2, 3]", "metrics.jsonl:3: a JSON list, not an object of metrics"),
        (b"\x00\x01\xff\xfe binary", "metrics.jsonl:3: not JSON"),
    ],
)
def test_a_line_that_is_not_a_json_object(
    tmp_path: Path, capsys, bad: str | bytes, says: str
) -> None:
    good = [json.dumps(r).encode() for r in [*rows(2), {"step": 3, "reward": 1}]]
    line = bad if isinstance(bad, bytes) else bad.encode()
    f = tmp_path / "metrics.jsonl"
    f.write_bytes(b"\n".join([good[0], good[1], line, good[2]]) + b"\n")
    rc, _, err = run_plot(capsys, f)
    assert_one_line_error(rc, err, says)


def test_a_key_no_file_has(demo_run: Path, cookbook_run: Path, capsys) -> None:
    rc, _, err = run_plot(capsys, demo_run, cookbook_run, "--keys", "reward,rewards")
    assert_one_line_error(
        rc,
        err,
        "--keys: no run has the key 'rewards'; close matches: reward",
        "env/all/reward/total",
    )
    rc, _, err = run_plot(capsys, demo_run, "--keys", "zzzz")
    assert_one_line_error(rc, err, "no run has the key 'zzzz'; --list shows the 12 numeric keys")
    rc, _, err = run_plot(capsys, demo_run, "--keys", "example")
    assert_one_line_error(rc, err, "--keys: 'example' has no numeric value in any run")
    rc, _, err = run_plot(capsys, demo_run, "--x", "tim_s")
    assert_one_line_error(
        rc, err, "--x (sr-run): no run has the key 'tim_s'; close matches: time_s"
    )


def test_bad_options(demo_run: Path, tmp_path: Path, capsys) -> None:
    rc, _, err = run_plot(capsys, demo_run, "--smooth", "0")
    assert_one_line_error(rc, err, "--smooth must be at least 1")
    rc, _, err = run_plot(capsys, demo_run, "--keys", " , ")
    assert_one_line_error(rc, err, "--keys: no key given")
    (tmp_path / "a-file").write_text("")
    rc, _, err = run_plot(capsys, demo_run, "--out", tmp_path / "a-file" / "x.png")
    assert_one_line_error(rc, err, "cannot write", "choose another file with --out")
    rc, _, err = run_plot(capsys, demo_run, "--out", tmp_path / "x.nosuchformat")
    assert_one_line_error(rc, err, "cannot write", "nosuchformat")
    strings = write_jsonl(tmp_path / "s" / "metrics.jsonl", [{"step": "a", "msg": "hi"}])
    rc, _, err = run_plot(capsys, strings)
    assert_one_line_error(rc, err, "no numeric metric in any run")


def test_the_real_command_line(demo_run: Path, tmp_path: Path) -> None:
    """`python -m tinker_sr plot` as a user runs it: exit codes and streams."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def tinker_sr(*argv: str | Path) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "tinker_sr", "plot", *map(str, argv)]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)

    done = tinker_sr(demo_run, "--out", tmp_path / "cli.png")
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'cli.png'}" in done.stdout
    assert_png(tmp_path / "cli.png")
    bad = tinker_sr(tmp_path / "missing")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == f"tinker-sr plot: {tmp_path / 'missing'}: no such file or directory\n"


def test_a_terminal_that_is_not_utf8_gets_the_text_summary_escaped(tmp_path: Path) -> None:
    """Before: with stdout in ASCII (``LC_ALL=C``, ``PYTHONIOENCODING=ascii``, a Windows
    console) the text summary's sparkline failed with UnicodeEncodeError (so did the demo's
    last line, on a sample holding U+FFFD)."""
    f = write_jsonl(tmp_path / "run" / "metrics.jsonl", rows(12))
    code = "import sys; sys.modules['matplotlib'] = None; from tinker_sr.cli import main; "
    code += f"sys.exit(main(['plot', {str(f)!r}]))"
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "\\u2588" in done.stdout and "no PNG: matplotlib is not available" in done.stdout


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path) -> None:
    """``tinker-sr plot --list ... | head -1``: the pipe closes before the output is written."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i, "reward": i / 10}) + "\n" for i in range(5)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinker_sr", "plot", "--list", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the interpreter has even started: every write hits a closed pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


# ---- found in review (h36c) -------------------------------------------------------------------


def test_a_run_just_started_beside_others_is_left_out(tmp_path: Path, capsys) -> None:
    write_jsonl(tmp_path / "sweep" / "seed0" / "metrics.jsonl", rows(4))
    (tmp_path / "sweep" / "seed1").mkdir()
    (tmp_path / "sweep" / "seed1" / "metrics.jsonl").write_text('{"step": 0, "rew')
    rc, out, err = run_plot(capsys, tmp_path / "sweep", "--out", tmp_path / "s.png")
    assert rc == 0, err
    assert "seed1: left out:" in out and "seed0: 4 steps" in out
    (tmp_path / "sweep" / "seed0" / "metrics.jsonl").write_text("")
    rc, _, err = run_plot(capsys, tmp_path / "sweep", "--out", tmp_path / "s.png")
    assert_one_line_error(rc, err, "no metrics to plot")  # no run has any: still an error


def test_a_dollar_in_a_key_or_run_name_is_drawn_literally(tmp_path: Path, capsys) -> None:
    write_jsonl(tmp_path / "m$\\frac$" / "metrics.jsonl", rows(3, **{"a$\\frac{$b": 1.0}))
    png = tmp_path / "d.png"
    rc, _, err = run_plot(capsys, tmp_path / "m$\\frac$", "--keys", "a$\\frac{$b", "--out", png)
    assert rc == 0, err
    assert_png(png)


def test_cookbook_timings_are_not_picked_as_rewards(tmp_path: Path, capsys) -> None:
    extra = {"time/compute_group_rewards:total": 0.1, "env/all/reward/total": 0.5}
    write_jsonl(tmp_path / "run" / "metrics.jsonl", rows(3, **extra))
    rc, out, _ = run_plot(capsys, tmp_path / "run", "--out", tmp_path / "r.png")
    assert rc == 0 and "time/" not in out.split("keys: ")[1]


def test_a_deeply_nested_line_and_a_bom(tmp_path: Path, capsys) -> None:
    deep = write_jsonl(tmp_path / "deep" / "metrics.jsonl", rows(1), '{"a":' * 100_000 + "\n")
    rc, _, err = run_plot(capsys, deep)
    assert_one_line_error(rc, err, ":2: not JSON (nested too deeply)")
    bom = tmp_path / "bom" / "metrics.jsonl"
    bom.parent.mkdir()
    bom.write_text("".join(json.dumps(r) + "\n" for r in rows(3)), encoding="utf-8-sig")
    rc, out, err = run_plot(capsys, bom, "--out", tmp_path / "b.png")
    assert rc == 0 and "3 steps" in out, err


def test_moving_average_is_linear_and_exact() -> None:
    ys = [float(i % 7) if i % 11 else math.nan for i in range(20_000)]
    fast = plot.moving_average(ys, 500)
    for i in (1, 499, 500, 7_777, 19_999):
        window = [y for y in ys[max(0, i - 499) : i + 1] if not math.isnan(y)]
        assert fast[i] == math.fsum(window) / len(window)
