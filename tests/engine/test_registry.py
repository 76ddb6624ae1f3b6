"""The memory model: one shared frozen base, adapters per trainer/sampler, budgets, release."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinker_sr.engine.lora import LoraSpec, lora_state_dict
from tinker_sr.engine.optim import AdamHParams
from tinker_sr.engine.registry import ModelRegistry, Sampler, Trainer, snapshot
from tinker_sr.engine.sampler import generate
from tinker_sr.user_errors import EngineUserError

MODEL = "tinker-sr/tiny"
SPEC = LoraSpec(rank=4, seed=0)


def _registry(**budgets: int) -> ModelRegistry:
    return ModelRegistry({}, sampler_dtype=torch.float32, **budgets)


def _trainer(reg: ModelRegistry, model_id: str, session: str = "s") -> Trainer:
    model, optim = reg.new_trainable(MODEL, SPEC)
    t = Trainer(model_id, session, MODEL, MODEL, SPEC, model, optim)
    reg.register_trainer(t)
    return t


def _perturbed(t: Trainer, scale: float) -> dict[str, torch.Tensor]:
    """Non-zero adapters (B starts at zero, which would make every sampler the base)."""
    gen = torch.Generator().manual_seed(int(scale * 100))
    return {k: torch.randn(v.shape, generator=gen) * scale for k, v in snapshot(t.model).items()}


def _tokens(model: torch.nn.Module) -> list[list[int]]:
    outs = generate(model, [1, 2, 3], num_samples=2, max_tokens=6, seed=5)  # type: ignore[arg-type]
    return [o.tokens for o in outs]


def test_trainers_share_one_frozen_base() -> None:
    reg = _registry()
    a, b = _trainer(reg, "a"), _trainer(reg, "b")
    base = reg.base(MODEL)
    for m in (a.model, b.model):
        w = m.model.layers[0].self_attn.q_proj.weight
        assert w.data_ptr() == base.model.layers[0].self_attn.q_proj.weight.data_ptr()
        assert not w.requires_grad
    before = base.model.layers[0].mlp.up_proj.weight.clone()
    loss = a.model(torch.tensor([[1, 2, 3, 4]])).sum()
    loss.backward()
    a.optim.step(AdamHParams(learning_rate=0.1))
    assert torch.equal(base.model.layers[0].mlp.up_proj.weight, before)
    # b's adapters are its own: a's step moved a's B matrices (zero at init), not b's.
    moved = [k for k, v in lora_state_dict(a.model).items() if "lora_B" in k and v.any()]
    assert moved and not any(lora_state_dict(b.model)[k].any() for k in moved)


def test_sampler_outputs_do_not_depend_on_where_its_weights_live() -> None:
    """Merged (cached), spilled to a file and read back, or adapters on the shared base: the
    same tokens."""
    reg = _registry(adapter_budget_bytes=0)  # every sampler's adapters go to a file
    t = _trainer(reg, "t")
    adapters = _perturbed(t, 0.05)
    reg.register_sampler(Sampler("p", "s", MODEL, MODEL, SPEC, None), adapters)
    assert reg.stats()["adapters_spilled"] == 1
    merged = _tokens(reg.sampler("p").model)
    unmerged_reg = _registry(merged_budget_bytes=0)
    unmerged_reg.register_sampler(Sampler("p", "s", MODEL, MODEL, SPEC, None), adapters)
    assert unmerged_reg.stats()["merged"] == 0
    assert _tokens(unmerged_reg.sampler("p").model) == merged
    assert merged != _tokens(reg.base(MODEL))  # the adapters matter


def test_merged_cache_is_lru_under_its_budget() -> None:
    reg = _registry()
    t = _trainer(reg, "t")
    reg.register_sampler(Sampler("p0", "s", MODEL, MODEL, SPEC, None), _perturbed(t, 0.01))
    one = reg.stats()["merged_bytes"]
    reg.merged_budget = 2 * one
    for i in (1, 2):
        reg.register_sampler(Sampler(f"p{i}", "s", MODEL, MODEL, SPEC, None), _perturbed(t, i))
    assert reg.stats()["merged"] == 2 and "p0" not in reg._merged
    assert reg.sampler("p0").model is not None  # rebuilt from its adapters; p1 is evicted
    assert list(reg._merged) == ["p2", "p0"]


def test_release_session_frees_everything_of_it() -> None:
    reg = _registry(adapter_budget_bytes=0)
    t = _trainer(reg, "a", session="s1")
    _trainer(reg, "b", session="s2")
    reg.register_sampler(Sampler("p", "s1", MODEL, MODEL, SPEC, None), _perturbed(t, 0.1))
    spill = next(iter(reg._spilled.values()))
    assert sorted(reg.release_session("s1")) == ["a", "p"]
    assert not spill.exists()
    assert reg.stats()["trainers"] == 1 and reg.stats()["samplers"] == 0
    assert reg.stats()["bases"] == 1  # s2 still uses it
    reg.release_session("s2")
    assert reg.stats()["bases"] == 0
    with pytest.raises(Exception, match="unknown model_id"):
        reg.trainer("a")


def test_spill_dir_is_removed_at_exit_without_close(tmp_path: Path) -> None:
    """A process that spills adapters and exits without `close` leaves no temp dir behind."""
    code = (
        "import torch, tempfile\n"
        f"tempfile.tempdir = {str(tmp_path)!r}\n"
        "from tinker_sr.engine.registry import ModelRegistry, Sampler\n"
        "from tinker_sr.engine.lora import LoraSpec\n"
        "reg = ModelRegistry({}, sampler_dtype=torch.float32, adapter_budget_bytes=0)\n"
        "spec = LoraSpec(rank=4, seed=0)\n"
        "model, _ = reg.new_trainable('tinker-sr/tiny', spec)\n"
        "from tinker_sr.engine.registry import snapshot\n"
        "s = Sampler('p', 's', 'tinker-sr/tiny', 'tinker-sr/tiny', spec, None)\n"
        "reg.register_sampler(s, snapshot(model))\n"
        "assert reg.stats()['adapters_spilled'] == 1\n"
        "print(next(iter(reg._spilled.values())).parent)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    spill_dir = Path(out.stdout.strip().splitlines()[-1])
    assert spill_dir.parent == Path(tmp_path)
    assert not spill_dir.exists()


def test_a_killed_processes_spill_dir_is_removed_by_the_next_registry(tmp_path: Path) -> None:
    """Found by a soak hunt: a server killed (SIGKILL) left its spill directory (148 MB at
    rank 64 on tinker-sr/small, per crash) in the temp dir for good."""
    import tempfile

    from tinker_sr.engine import spill

    code = (
        "import os, tempfile, torch\n"
        f"tempfile.tempdir = {str(tmp_path)!r}\n"
        "from tinker_sr.engine.registry import ModelRegistry, Sampler, snapshot\n"
        "from tinker_sr.engine.lora import LoraSpec\n"
        "reg = ModelRegistry({}, sampler_dtype=torch.float32, adapter_budget_bytes=0)\n"
        "spec = LoraSpec(rank=4, seed=0)\n"
        "model, _ = reg.new_trainable('tinker-sr/tiny', spec)\n"
        "s = Sampler('p', 's', 'tinker-sr/tiny', 'tinker-sr/tiny', spec, None)\n"
        "reg.register_sampler(s, snapshot(model))\n"
        "print(next(iter(reg._spilled.values())).parent, flush=True)\n"
        "os._exit(9)  # as a kill: no finalizer, no atexit\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    killed = Path(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 9 and killed.exists() and killed.parent == tmp_path, out.stderr
    saved = tempfile.tempdir
    tempfile.tempdir = str(tmp_path)
    try:
        live = spill.SpillDir()  # this process's: locked, never swept
        old = tmp_path / f"{spill.PREFIX}older-version"  # unmarked: cannot be told from live
        old.mkdir()
        (tmp_path / f"{spill.PREFIX}link").symlink_to(killed)  # a link is never followed
        _registry()  # a new registry (a restarted server) sweeps at start
    finally:
        tempfile.tempdir = saved
    assert not killed.exists() and Path(live.path).exists() and old.exists()
    live.close()
    assert not Path(live.path).exists()


@pytest.mark.parametrize("failure", ["oserror", "safetensors"])
def test_a_spill_that_fails_keeps_the_adapters_in_memory(
    failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while spilling: the sampler is registered and samples as it would from a
    file, its adapters kept in memory over budget (review); no partial file stays. The real
    library's failure is a ``SafetensorError``, not an OSError (hunt: a full TMPDIR failed
    ``save_weights_and_get_sampling_client`` with "internal error: SafetensorError")."""
    from tinker_sr.engine import registry as registry_module

    def disk_full(tensors: object, path: str) -> None:
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    reg = _registry(adapter_budget_bytes=0)
    adapters = _perturbed(_trainer(reg, "t"), 0.05)
    if failure == "oserror":
        monkeypatch.setattr(registry_module, "save_file", disk_full)
    else:  # safetensors' own error: a directory where its file goes
        reg._spill_dir = reg._new_spill_dir()
        for i in range(4):
            (Path(reg._spill_dir.path) / f"{i}.st").mkdir()
    reg.register_sampler(Sampler("p", "s", MODEL, MODEL, SPEC, None), adapters)
    assert reg.stats()["adapters_spilled"] == 0
    assert reg._spill_dir is not None
    assert not [f for f in Path(reg._spill_dir.path).glob("*.st") if f.is_file()]
    monkeypatch.undo()
    spilled = _registry(adapter_budget_bytes=0)
    spilled.register_sampler(Sampler("p", "s", MODEL, MODEL, SPEC, None), adapters)
    assert _tokens(reg.sampler("p").model) == _tokens(spilled.sampler("p").model)


@pytest.mark.parametrize("name", [123, None, ""])
def test_base_model_of_the_wrong_type_is_a_user_error_naming_the_field(name: object) -> None:
    with pytest.raises(EngineUserError, match="base_model must be a non-empty string"):
        _registry().resolve_model(name)  # type: ignore[arg-type]


def test_a_session_keeps_only_its_most_recently_used_lora_samplers() -> None:
    """An RL loop that makes a sampler every step never says when it drops one: the session
    keeps the adapters of its N most recently used LoRA samplers (memory and spill files stay
    bounded), keeps its base-model samplers (up to many more), and names the quota when an old
    one is used."""
    from tinker_sr.user_errors import EngineNotFoundError

    reg = _registry(samplers_per_session=2, adapter_budget_bytes=0)
    t = _trainer(reg, "t")
    reg.register_sampler(Sampler("base", "s", MODEL, MODEL, None, None))
    for i in range(3):
        reg.register_sampler(Sampler(f"p{i}", "s", MODEL, MODEL, SPEC, None), _perturbed(t, 0.1))
        reg.sampler("p0")  # p0 stays in use, so p1 is the least recently used
    reg.register_sampler(Sampler("other", "s2", MODEL, MODEL, SPEC, None), _perturbed(t, 0.2))
    assert {reg.sampler(k).sampler_id for k in ("base", "p0", "p2", "other")} == {
        "base",
        "p0",
        "p2",
        "other",
    }
    with pytest.raises(EngineNotFoundError, match="2 most recently used LoRA sampling clients"):
        reg.sampler("p1")
    assert reg.stats()["samplers"] == 4 and reg.stats()["adapters_spilled"] == 3


def test_a_session_keeps_its_most_recently_used_base_samplers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop making a base-model sampling client every step kept every one (~1 KB each, and a
    scan of them all at each new one); a session now keeps its most recently used
    `BASE_SAMPLERS_PER_SESSION`, other sessions' untouched."""
    from tinker_sr.engine import registry
    from tinker_sr.user_errors import EngineNotFoundError

    monkeypatch.setattr(registry, "BASE_SAMPLERS_PER_SESSION", 3)
    reg = _registry()
    reg.register_sampler(Sampler("theirs", "s2", MODEL, MODEL, None, None))
    for i in range(5):
        reg.register_sampler(Sampler(f"b{i}", "s", MODEL, MODEL, None, None))
        reg.sampler("b0")  # in use: kept
    assert [reg.sampler(k).sampler_id for k in ("theirs", "b0", "b3", "b4")]
    for gone in ("b1", "b2"):
        with pytest.raises(EngineNotFoundError, match="3 most recently used base-model ones"):
            reg.sampler(gone)


def _ptrs(reg: ModelRegistry, sampler_id: str) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in reg._merged[sampler_id][0].named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_new_merged_copy_is_written_into_an_evicted_copys_own_weights(
    dtype: torch.dtype,
) -> None:
    """A sampler per RL step, one merged copy kept: the next copy's merged weights (and, in
    another dtype than the base's, its converted ones) go into the evicted copy's memory (no
    new allocation to fault in), base weights stay shared, and the values are the bits a
    fresh copy holds. A copy a decode still holds keeps its memory."""
    reg = ModelRegistry({}, sampler_dtype=dtype)
    t = _trainer(reg, "t")
    reg.register_sampler(Sampler("p0", "s", MODEL, MODEL, SPEC, None), _perturbed(t, 0.01))
    reg.merged_budget = reg.stats()["merged_bytes"]  # one copy
    first, base = _ptrs(reg, "p0"), reg.base(MODEL)
    shared = {n for n, p in base.named_parameters() if p.data_ptr() in first.values()}
    own = set(first) - shared
    assert "model.layers.0.self_attn.q_proj.weight" in own and "lm_head.weight" in own
    # Not adapted: the base's own tensor (never rewritten), or its converted copy.
    assert ("model.embed_tokens.weight" in shared) == (dtype == torch.float32)
    base_before = {n: p.clone() for n, p in base.named_parameters()}

    adapters = _perturbed(t, 0.5)
    reg.register_sampler(Sampler("p1", "s", MODEL, MODEL, SPEC, None), adapters)
    assert "p0" not in reg._merged
    second = _ptrs(reg, "p1")
    assert {n for n in own if second[n] == first[n]} == own  # rewritten in place
    assert all(second[n] == first[n] for n in shared)
    fresh = ModelRegistry({}, sampler_dtype=dtype)
    fresh.register_sampler(Sampler("p1", "s", MODEL, MODEL, SPEC, None), adapters)
    want = dict(fresh._merged["p1"][0].named_parameters())
    for n, p in reg._merged["p1"][0].named_parameters():
        assert torch.equal(p, want[n]), n
    assert all(torch.equal(p, base_before[n]) for n, p in base.named_parameters())

    held = reg.sampler("p1").model  # as a decode holds the model it samples with
    tokens = _tokens(held)
    reg.register_sampler(Sampler("p2", "s", MODEL, MODEL, SPEC, None), _perturbed(t, 0.2))
    assert "p1" not in reg._merged
    third = _ptrs(reg, "p2")
    assert not {n for n in own if third[n] == second[n]}  # new memory: p1's is still read
    assert _tokens(held) == tokens
    assert all(torch.equal(p, want[n]) for n, p in held.named_parameters())


def test_reclaim_weights_leaves_what_anyone_still_uses() -> None:
    """A weight with a live view or alias, or shared with a base, is not handed out."""
    from tinker_sr.engine.lora import reclaim_weights

    reg = _registry()
    t = _trainer(reg, "t")
    reg.register_sampler(Sampler("p", "s", MODEL, MODEL, SPEC, None), _perturbed(t, 0.1))
    copies = [reg._merged.pop("p")[0]]  # the list is the copy's only holder
    q = "model.layers.0.self_attn.q_proj.weight"
    view = copies[0].get_submodule("model.layers.0.self_attn.q_proj").weight[0]
    alias = copies[0].get_submodule("model.layers.0.mlp.up_proj").weight.detach()
    like = dict(t.model.named_parameters(remove_duplicate=False))
    got = reclaim_weights(copies, like, torch.float32)
    assert not copies
    assert q not in got and "model.layers.0.mlp.up_proj.weight" not in got
    assert "model.embed_tokens.weight" not in got  # the base's
    assert "model.layers.1.self_attn.q_proj.weight" in got and "lm_head.weight" in got
    assert view.shape == alias.shape[1:]


def test_a_sampler_in_use_is_never_missing_to_a_lock_free_lookup() -> None:
    """`live_sampler` (the server's admission checks) reads without the lock while the sampling
    thread marks samplers used. Before: that was a pop and a re-insert, and 5 % of lookups
    between them found a loaded sampler missing (a false "restarted" 404, a skipped check)."""
    import sys
    import threading

    from tinker_sr.engine.registry import ModelRegistry

    registry = ModelRegistry({})
    registry._samplers["s1"] = object()  # type: ignore[assignment]
    stop = threading.Event()

    def use() -> None:
        while not stop.is_set():
            registry.sampler("s1")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    user = threading.Thread(target=use)
    user.start()
    try:
        misses = sum(registry.live_sampler("s1") is None for _ in range(100_000))
    finally:
        stop.set()
        user.join()
        sys.setswitchinterval(interval)
    assert misses == 0
