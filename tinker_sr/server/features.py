"""Feature switches that make the server play an engine without StableReinforce support.

Other Tinker-compatible engines (SkyRL's Tinker server, Miles) refuse
``loss_fn="stable_reinforce"`` with a 422, drop ``record_stability_info`` silently, and some
take only 1-D ``cross_entropy`` targets. ``tinker-sr serve --without-stable-reinforce
--ignore-stability-info [--only-1d-targets]`` answers the same way, so the client-side
lowering of StableReinforce (``tinker_sr.clients.sr_lowering``) is tested against a real
server. The default is every feature on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinker_sr.wire.proto import ForwardBackwardCall

from .http import HTTPError

__all__ = ["ServerFeatures"]


@dataclass(frozen=True)
class ServerFeatures:
    stable_reinforce: bool = True
    """Accept ``loss_fn="stable_reinforce"``; off: 422 at submit, like an engine without it."""

    record_stability_info: bool = True
    """Honour ``record_stability_info``; off: ignored silently (no draws are recorded)."""

    two_d_targets: bool = True
    """Accept 2-D ``target_tokens``; off: 422 at submit for any 2-D target."""

    sample_topk: bool = True
    """Return ``topk_sample_logprobs``; off: ignored silently (prompt top-k still works)."""

    @property
    def reduced(self) -> bool:
        return self.describe() != "all features"

    def describe(self) -> str:
        off = [
            name
            for name, on in (
                ("stable_reinforce", self.stable_reinforce),
                ("record_stability_info", self.record_stability_info),
                ("2-D targets", self.two_d_targets),
                ("topk_sample_logprobs", self.sample_topk),
            )
            if not on
        ]
        return "without " + ", ".join(off) if off else "all features"

    def check_forward_backward(self, call: ForwardBackwardCall) -> None:
        """Refuse what this server plays not to support (raises HTTPError 422)."""
        if not self.stable_reinforce and call.loss_fn == "stable_reinforce":
            raise HTTPError(
                422,
                "forward_backward: loss_fn 'stable_reinforce' is not supported by this server "
                "(started without stable_reinforce); use cross_entropy, importance_sampling, "
                "ppo, cispo, dro or gspo",
            )
        if not self.two_d_targets:
            for i, d in enumerate(call.data):
                tt = d.loss_fn_inputs.get("target_tokens")
                if tt is not None and np.asarray(tt.to_numpy()).ndim != 1:
                    raise HTTPError(
                        422,
                        f"forward_backward: datum {i}: loss_fn_inputs target_tokens must be 1-D "
                        "on this server (it takes no 2-D cross_entropy targets)",
                    )
