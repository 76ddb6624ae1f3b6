"""A real server subprocess for tests: see `tinker_sr.testing.server` (one implementation,
shared with the `tinker_server` pytest fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tinker_sr.testing.server import ServerProcess, free_port, running_server

REPO = Path(__file__).resolve().parents[1]

__all__ = [
    "REPO",
    "ServerProcess",
    "free_port",
    "official_sdk_sample",
    "running_server",
    "serving_model_dir",
]


@contextmanager
def serving_model_dir(tmp_path_factory: Any, model_dir: Path) -> Iterator[ServerProcess]:
    """A real server on a fresh store, serving `model_dir` as its operator would
    (``--model-dir``)."""
    store = tmp_path_factory.mktemp(f"{model_dir.name}_server") / "store"
    with running_server(store, extra_args=["--model-dir", str(model_dir)]) as srv:
        yield srv


def official_sdk_sample(
    srv: ServerProcess, base_model: str, ids: list[int], num_samples: int, key: str, **params: Any
) -> Any:
    """The official SDK's `SampleResponse` for prompt ``ids`` on ``srv`` with
    ``SamplingParams(**params)``: the oracle the other APIs' answers are held to."""
    import tinker

    service = tinker.ServiceClient(base_url=srv.base_url, api_key=key)
    try:
        sampler = service.create_sampling_client(base_model=base_model).result()
        prompt = tinker.ModelInput.from_ints(ids)
        return sampler.sample(prompt, num_samples, tinker.SamplingParams(**params)).result()
    finally:
        service.holder.close()
