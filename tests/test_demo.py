"""`tinker-sr demo` runs in-process and leaves a well-formed metrics log and plot behind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tinker_sr import cli
from tinker_sr.demo import PROMPTS, TIMING_KEYS, reward

STEP_KEYS = {
    "step",
    "reward",
    "reward_by_prompt",
    "kl_sampler_learner",
    "kl_k3",
    "entropy",
    "grad_norm",
    "loss",
    "tokens_per_s",
}


def run_demo(out: Path, *extra: str) -> list[dict]:
    argv = ["demo", "--steps", "3", "--group-size", "4", "--out", str(out), "--quiet", *extra]
    assert cli.main(argv) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_demo_writes_one_metrics_line_per_step_and_a_png(tmp_path: Path, capsys) -> None:
    records = run_demo(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert STEP_KEYS <= r.keys()
        assert 0.0 <= r["reward"] <= 1.0
        assert all(math.isfinite(r[k]) for k in STEP_KEYS - {"reward_by_prompt", "step"})
        # On-policy, in float32: the sampler and the learner agree on every token.
        assert abs(r["kl_sampler_learner"]) < 1e-4
        assert "loss:sum" in r["loss_metrics"] and "grad_norm:mean" in r["optim_metrics"]
    png = (tmp_path / "learning_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["loss"] == "stable_reinforce" and config["loss_fn_config"] == {"kl_coeff": 0.01}
    out = capsys.readouterr().out
    assert "reward" in out and str(tmp_path / "metrics.jsonl") in out
    # What the run used, as the engine counted it: one sample request per prompt and step.
    prompts = sum(len(p.encode()) for p in PROMPTS) * len(records)  # the model's ids are bytes
    used = next(line for line in out.splitlines() if line.startswith("usage:"))
    assert used.endswith(f"sampled, {prompts:,} prompt tokens (0 from the prompt cache)"), used


def test_without_matplotlib_the_run_still_reports(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """matplotlib is an extra ('tinker-sr[plot]'): without it the demo trained, then died in
    plot_curves with an ImportError traceback before printing its summary."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    records = run_demo(tmp_path)
    assert len(records) == 3 and not (tmp_path / "learning_curves.png").exists()
    out = capsys.readouterr().out
    assert "reward" in out and "samples at the last step" in out
    assert "plot:    not drawn: matplotlib is not installed" in out and "--no-plot" in out


def test_same_seed_gives_the_same_log_except_timings(tmp_path: Path) -> None:
    def strip(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]

    a = run_demo(tmp_path / "a", "--no-plot", "--seed", "7")
    b = run_demo(tmp_path / "b", "--no-plot", "--seed", "7")
    c = run_demo(tmp_path / "c", "--no-plot", "--seed", "8")
    assert strip(a) == strip(b)
    assert strip(a) != strip(c)
    assert not (tmp_path / "a" / "learning_curves.png").exists()


@pytest.mark.parametrize("loss", ["reinforce", "importance_sampling"])
def test_demo_under_stale_bf16_sampler_reports_the_mismatch(tmp_path: Path, loss: str) -> None:
    records = run_demo(
        tmp_path, "--no-plot", "--loss", loss, "--stress", "both", "--staleness", "1"
    )
    # A bfloat16 sampler really differs from the float32 learner.
    assert all(r["kl_k3"] > 0 for r in records)
    assert all(math.isfinite(r["kl_sampler_learner"]) for r in records)


def test_same_loop_against_a_server_gives_the_same_log(tmp_path: Path, remote_server) -> None:
    # remote_server (tests/conftest.py) is a real `tinker-sr serve` subprocess.
    local = run_demo(tmp_path / "local", "--no-plot")
    remote = run_demo(tmp_path / "remote", "--no-plot", "--base-url", remote_server.base_url)

    def strip(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]

    assert strip(remote) == strip(local)


def test_stress_with_base_url_is_a_clear_error(tmp_path: Path, capsys) -> None:
    argv = ["demo", "--base-url", "http://127.0.0.1:9", "--stress", "bf16", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    assert "--stress bf16" in capsys.readouterr().err


def test_staleness_without_a_stale_sampler_is_a_clear_error(tmp_path: Path, capsys) -> None:
    """It was ignored silently (the run had no stale sampler; config.json said 0)."""
    assert cli.main(["demo", "--staleness", "3", "--out", str(tmp_path)]) == 2
    assert "--staleness only applies with --stress stale" in capsys.readouterr().err


def test_a_server_that_cannot_run_the_demo_is_one_line(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead URL took a minute of retries and a 100-line traceback naming no URL; a server
    with its own keys (no --api-key given) or without stable_reinforce (--lowering never)
    ended in a traceback too. Each is now one line naming the URL or the refusal."""
    from tinker_sr import demo
    from tinker_sr.testing.server import free_port, running_server

    monkeypatch.setattr(demo, "SERVER_WAIT_S", 1.0)
    dead = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["demo", "--base-url", dead, "--out", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach {dead} (waited 1 s); is a server running there?" in err, err
    assert not (tmp_path / "a").exists()
    extra = ["--api-key", "tml-only", "--without-stable-reinforce"]
    with running_server(tmp_path / "store", extra_args=extra) as srv:
        argv = ["demo", "--steps", "1", "--base-url", srv.base_url, "--quiet"]
        assert cli.main([*argv, "--out", str(tmp_path / "b")]) == 1
        err = capsys.readouterr().err
        assert "refused the API key" in err and "pass the server's key with --api-key" in err
        never = [*argv, "--api-key", "tml-only", "--lowering", "never"]
        assert cli.main([*never, "--out", str(tmp_path / "c")]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("tinker-sr demo: UnprocessableEntityError") and "\n" not in err


def test_counting_reward_is_verifiable() -> None:
    assert reward("count: 3", list(b"45678901")) == 1.0
    # Only the first byte is the successor of its predecessor; the rest are digits.
    assert reward("count: 3", list(b"44444444")) == pytest.approx((1 + 7 * 0.25) / 8)
    assert reward("count: 8", list(b"90")) == 1.0
    assert reward("count: 0", list(b"abc")) == 0.0
    assert reward("count: 0", [256, 257]) == 0.0
