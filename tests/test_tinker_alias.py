"""``tinker-sr run`` and `tinker_sr.install_as_tinker`: unchanged ``import tinker`` code runs on
tinker_sr, with every module of the official SDK 0.38 resolved and one copy of each module.

The programs run in subprocesses: the alias must be installed before anything imports
``tinker``, and this test process has the official SDK loaded (tests/test_surface.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tinker_sr
from tinker_sr.tinker_alias import SDK_MODULES

REPO = Path(__file__).resolve().parents[1]


def sdk_module_tree() -> set[str]:
    spec = importlib.util.find_spec("tinker")
    if spec is None or spec.origin is None:
        pytest.skip("the official tinker SDK is not installed")
    root = Path(spec.origin).parent
    names = {"tinker"}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts and (parts[-1].endswith("_test") or parts[-1] == "__main__"):
            continue
        for i in range(1, len(parts) + 1):  # namespace packages (no __init__.py) count too
            names.add(".".join(["tinker", *parts[:i]]))
    return names


def run(
    tmp_path: Path, args: list[str], *, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TINKER_SR_STORE": str(tmp_path / "store")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("TINKER_BASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "tinker_sr", "run", *args],
        cwd=cwd or tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def test_module_list_matches_the_installed_sdk() -> None:
    tree = sdk_module_tree()
    assert SDK_MODULES == tree, (
        f"missing: {sorted(tree - SDK_MODULES)}\nno longer in the SDK: {sorted(SDK_MODULES - tree)}"
    )


def test_install_refuses_once_the_official_sdk_is_loaded() -> None:
    pytest.importorskip("tinker")
    if tinker_sr.tinker_alias.is_installed():  # pragma: no cover - never in this suite
        pytest.skip("installed in this process")
    with pytest.raises(RuntimeError, match="before anything imports tinker"):
        tinker_sr.install_as_tinker()


EVERY_MODULE = """
import importlib, json, sys
from pathlib import Path
import tinker_sr
from tinker_sr.tinker_alias import SDK_MODULES, resolve

report = {"aliased": 0, "stand_in": 0, "problems": []}
for name in sorted(SDK_MODULES):
    module = importlib.import_module(name)
    target = resolve(name)
    if target is None:
        report["stand_in"] += 1
        if module.__name__ != name:
            report["problems"].append(f"{name}: stand-in named {module.__name__}")
    elif module is not sys.modules[target]:
        report["problems"].append(f"{name}: not the module {target}")
    else:
        report["aliased"] += 1
# One copy of each tinker_sr file, however many names it is imported under.
root = Path(tinker_sr.__file__).parent
files = {}
for mod in list(sys.modules.values()):
    f = getattr(mod, "__file__", None)
    if f and Path(f).is_relative_to(root):
        files.setdefault(f, set()).add(id(mod))
report["duplicated"] = sorted(f for f, ids in files.items() if len(ids) > 1)

import tinker
from tinker import types, TensorData, AdminClient, APIFuture, SamplingClient, ModelInput
from tinker.types import LossFnType, AuditLogEntry, AuditLogResponse
from tinker.types.tensor_data import TensorData as TD2
from tinker.lib.public_interfaces.rest_client import RestClient
from tinker.lib.public_interfaces import APIFuture as F2
from tinker.types.sample_request import SampleRequest
report["identity"] = [
    tinker is tinker_sr, types is tinker_sr.types, TD2 is TensorData is tinker_sr.TensorData,
    RestClient is tinker_sr.RestClient, F2 is APIFuture is tinker_sr.APIFuture,
    SampleRequest is tinker_sr.types.SampleRequest, AuditLogEntry is tinker_sr.types.AuditLogEntry,
]
try:
    from tinker.lib.internal_client_holder import InternalClientHolder
except ImportError as e:
    report["missing_name"] = str(e)
try:
    import tinker.not_a_module
except ModuleNotFoundError as e:
    report["missing_module"] = str(e)
import tinker_sr.cli
report["our_cli_intact"] = hasattr(tinker_sr.cli, "main")
print(json.dumps(report))
"""


def test_every_sdk_module_resolves_once(tmp_path: Path) -> None:
    proc = run(tmp_path, [str(write(tmp_path / "every.py", EVERY_MODULE))])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["problems"] == [] and report["duplicated"] == []
    assert report["aliased"] >= 15 and report["aliased"] + report["stand_in"] == len(SDK_MODULES)
    assert all(report["identity"]), report["identity"]
    assert "InternalClientHolder" in report["missing_name"]
    assert "tinker.not_a_module" in report["missing_module"]
    assert report["our_cli_intact"]


TRAIN = """
import sys
import numpy as np
import tinker
from tinker import types
from tinker.types.tensor_data import TensorData

service = tinker.ServiceClient()
training = service.create_lora_training_client("tinker-sr/tiny", rank=2, seed=0)
tokens = [5, 6, 7, 8, 9]
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={
        # The SDK-module spelling of TensorData: a second copy of the class used to be rejected.
        "target_tokens": TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
        "weights": TensorData.from_numpy(np.ones(4, dtype=np.float32)),
    },
)
losses = []
for _ in range(3):
    out = training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    losses.append(out.metrics["loss:sum"])
print("argv", sys.argv[1:], "name", __name__)
print("losses", losses)
assert losses[0] > losses[-1], losses
"""


def test_run_script_trains_with_sdk_module_types(tmp_path: Path) -> None:
    script = write(tmp_path / "train.py", TRAIN)
    proc = run(tmp_path, [str(script), "--flag", "-m", "x"])
    assert proc.returncode == 0, proc.stderr
    assert "argv ['--flag', '-m', 'x'] name __main__" in proc.stdout


def test_run_module_and_exit_codes(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write(
        pkg / "prog.py",
        """
        import sys, tinker
        print("module run", sys.argv[1:], tinker.__name__)
        sys.exit(int(sys.argv[1]))
        """,
    )
    proc = run(tmp_path, ["-m", "mypkg.prog", "3", "-q"])
    assert proc.returncode == 3 and "module run ['3', '-q'] tinker_sr" in proc.stdout
    missing = run(tmp_path, ["-m", "mypkg.nope"])
    assert missing.returncode == 2 and "no module named 'mypkg.nope'" in missing.stderr
    no_file = run(tmp_path, ["nope.py"])
    assert no_file.returncode == 2 and "can't open file 'nope.py'" in no_file.stderr


SPAWNS = """
import multiprocessing as mp
import subprocess
import sys

import tinker


def child(_: int) -> str:
    import tinker
    from tinker.types.tensor_data import TensorData

    return f"{tinker.__name__} {TensorData.__module__}"


if __name__ == "__main__":
    with mp.get_context("spawn").Pool(1) as pool:
        print("spawn:", pool.map(child, [0])[0])
    code = "import os, tinker; print(tinker.__name__, os.getpid())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    print("subprocess:", out.stdout.strip())
"""


def test_started_interpreters_alias_tinker_too(tmp_path: Path) -> None:
    """Subprocesses and multiprocessing spawn workers of a `tinker-sr run` program get tinker_sr
    (through the sitecustomize hook), and a sitecustomize the hook shadows still runs."""
    theirs = tmp_path / "their_site"
    theirs.mkdir()
    log = tmp_path / "their_site.log"
    (theirs / "sitecustomize.py").write_text(
        f"import os\nwith open({str(log)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n"
    )
    write(tmp_path / "spawns.py", SPAWNS)
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(theirs), env_path]))
    try:
        proc = run(tmp_path, [str(tmp_path / "spawns.py")])
    finally:
        if env_path is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_path
    assert proc.returncode == 0, proc.stderr
    assert "spawn: tinker_sr tinker_sr.types.tensor_data" in proc.stdout
    child = proc.stdout.split("subprocess: tinker_sr ")[1].split()[0]
    assert child in log.read_text().split(), "the shadowed sitecustomize did not run in the child"


def test_the_official_sdks_objects_given_to_tinker_sr_clients_say_how_to_mix_them(
    tmp_path: Path,
) -> None:
    """A script that does `import tinker_sr as tinker` but also builds objects from the official
    SDK (tinker-cookbook does, without the alias): each refusal says whose type it got and
    names the fix (before: "must be a Datum, got Datum", pydantic's "not a ModelInput")."""
    import tinker

    from tinker_sr.backend.local import LocalBackend

    backend = LocalBackend(tmp_path / "store")
    service = tinker_sr.ServiceClient(backend=backend)
    try:
        training = service.create_lora_training_client("tinker-sr/tiny", rank=4).result()
        prompt = tinker.ModelInput.from_ints([1, 2, 3])
        datum = tinker.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": [2, 3, 4]})
        fix = "official SDK's tinker.{}: .*install_as_tinker\\(\\).*tinker-sr run"
        with pytest.raises(TypeError, match=fix.format("Datum")):  # any backend: before the wire
            training.forward_backward([datum], "cross_entropy")
        with pytest.raises(TypeError, match=fix.format("AdamParams")):
            training.optim_step(tinker.AdamParams(learning_rate=1e-3))
        sampler = training.save_weights_and_get_sampling_client().result()
        ours = tinker_sr.ModelInput.from_ints([1])
        with pytest.raises(TypeError, match=fix.format("ModelInput")):
            sampler.sample(prompt, 1, tinker_sr.SamplingParams(max_tokens=2))
        with pytest.raises(TypeError, match=fix.format("SamplingParams")):
            sampler.sample(ours, 1, tinker.SamplingParams())
        with pytest.raises(TypeError, match=fix.format("ModelInput")):
            sampler.compute_logprobs(prompt)
        with pytest.raises(TypeError, match=fix.format("ModelInput")):
            tinker_sr.Datum(model_input=prompt, loss_fn_inputs={})
        assert sampler.compute_logprobs(ours).result() == [None]
    finally:
        service.close().result()
        backend.close()


def test_started_interpreters_get_only_the_hook_ahead_of_their_path(tmp_path: Path) -> None:
    """The folder holding tinker_sr (site-packages, when installed) went on the program's
    PYTHONPATH too, ahead of every started interpreter's own standard library and packages: a
    child of another virtualenv imported this one's pydantic and numpy, one of another Python
    version failed in sitecustomize. Now only the hook goes first, and a hook found twice on
    the path (a symlinked copy) no longer recurses until RecursionError."""
    write(tmp_path / "show.py", 'import os\nprint("PP=" + os.environ["PYTHONPATH"])\n')
    proc = run(tmp_path, [str(tmp_path / "show.py")])
    assert proc.returncode == 0, proc.stderr
    given = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    hook = str(REPO / "tinker_sr" / "_as_tinker")
    assert f"PP={hook}{os.pathsep}{given}" in proc.stdout.splitlines()

    (tmp_path / "hook-link").symlink_to(hook)
    import shutil

    shutil.copytree(hook, tmp_path / "hook-copy")  # another install's copy of the hook
    theirs = tmp_path / "their_site"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("print('theirs ran')\n")
    env = {**os.environ, "TINKER_SR_AS_TINKER": "1"}
    path = [hook, str(tmp_path / "hook-link"), str(tmp_path / "hook-copy"), str(theirs)]
    env["PYTHONPATH"] = os.pathsep.join([*path, str(REPO)])
    code = "import tinker, tinker_sr; print(tinker.ServiceClient is tinker_sr.ServiceClient)"
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["theirs", "ran", "True"], (child.stdout, child.stderr[-2000:])
    assert "RecursionError" not in child.stderr
