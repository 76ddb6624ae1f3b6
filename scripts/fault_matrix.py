"""What a client surfaces when a wire fault never clears (docs/testing.md, last column).

    python scripts/fault_matrix.py tinker       # the official SDK
    python scripts/fault_matrix.py tinker_sr    # tinker_sr over HTTP
    python scripts/fault_matrix.py tinker --once  # each fault once: retried transparently?

Each fault is planned on every matching call (``times=None``; ``--once``: one call) in
`mock_tinker`, and one sample or forward_backward waits for its result up to ``--wait``
seconds. Prints one line per fault: what reached the caller, the wait, and how many requests
the fault answered. Slow (about ``--wait`` seconds per fault); not part of the test suite.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable
from typing import Any

from tinker_sr.testing import (
    WireFault,
    connection_reset,
    future_stays_pending,
    http_error,
    mock_tinker,
    rate_limited,
    request_timeout,
    slow_response,
)

FAULTS: list[tuple[str, Callable[[int | None], WireFault], str]] = [
    ("429 + Retry-After on asample", lambda t: rate_limited("asample", 0.5, times=t), "sample"),
    ("500 on asample", lambda t: http_error("asample", 500, times=t), "sample"),
    ("502 on forward_backward", lambda t: http_error("forward_backward", 502, times=t), "fb"),
    ("503 on retrieve_future", lambda t: http_error("retrieve_future", 503, times=t), "fb"),
    ("reset on asample", lambda t: connection_reset("asample", times=t), "sample"),
    ("reset on retrieve_future", lambda t: connection_reset("retrieve_future", times=t), "fb"),
    ("timeout on asample", lambda t: request_timeout("asample", times=t), "sample"),
    ("timeout on retrieve_future", lambda t: request_timeout("retrieve_future", times=t), "fb"),
    ("slow forward_backward (1 s)", lambda t: slow_response("forward_backward", 1.0, times=t),
     "fb"),
    ("try_again on retrieve_future", lambda t: future_stays_pending(times=t), "sample"),
]  # fmt: skip


def _call(module: Any, training: Any, sampler: Any, op: str, wait: float) -> Any:
    types = module.types
    if op == "sample":
        params = types.SamplingParams(max_tokens=3, seed=0)
        return sampler.sample(types.ModelInput.from_ints([259, 104]), 1, params).result(wait)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4},
    )
    return training.forward_backward([datum], "cross_entropy").result(wait)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("client", choices=["tinker", "tinker_sr"])
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait per call")
    p.add_argument("--once", action="store_true", help="fire each fault once, not forever")
    args = p.parse_args()
    module = importlib.import_module(args.client)
    with mock_tinker() as mock:
        service = module.ServiceClient()
        training = service.create_lora_training_client("Qwen/Qwen3-8B", rank=4).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        for name, make, op in FAULTS:
            mock.faults.clear()
            fault = mock.add_fault(make(1 if args.once else None))
            t0 = time.monotonic()
            try:
                outcome = (
                    f"returned {type(_call(module, training, sampler, op, args.wait)).__name__}"
                )
            except Exception as e:
                outcome = f"raised {type(e).__module__}.{type(e).__name__}: {str(e)[:90]}"
            took = time.monotonic() - t0
            print(f"{name:30s} {took:6.1f} s  fired {fault.fired:6d}x  {outcome}", flush=True)


if __name__ == "__main__":
    main()
