"""The privacy claim a membership attack is checked against, per observation.

A record of an observed client is protected by (a) its client's DP-SGD (``dp = local``,
record-level, add/remove one record), composed over every step the client took up to
the observed round, or (b) under central DP, DP-FedAvg's releases composed up to that
round, accounted record-level (sensitivity 2C a round, no amplification; what a change of
one record inside a participating client is bounded by). What the server observes of a
round is post-processing of those mechanisms, so the claim bounds any attack on it: the
client's update under local DP; under central DP only the *released* model is covered
(the raw update the server holds is not, and is not checked against the claim).
"""

from __future__ import annotations

from typing import Any

from privacy.attacks.observation import Observation
from privacy.dp.tradeoff import Claim, dpsgd_event, pld_profile
from tasks.config import RunConfig
from tasks.results.ledger import RoundRecord


def local_claim(client: dict[str, Any]) -> Claim | None:
    """A client's DP-SGD claim from what it disclosed (epsilon, delta, sigma, q, steps)."""
    try:
        eps, delta = float(client["epsilon"]), float(client["delta"])
        sigma, q = float(client["noise-multiplier"]), float(client["sample-rate"])
        steps = int(client["dp-steps"])
    except (KeyError, TypeError, ValueError):
        return None
    profile = pld_profile(dpsgd_event(sigma, q, steps)) if steps else ()
    return Claim(eps, delta, f"client {client.get('partition-id')}'s DP-SGD (sigma {sigma:g}, "
                 f"q {q:.3g}, {steps} steps; record-level)", profile)


def membership_claim(cfg: RunConfig, obs: Observation, ledger: list[RoundRecord],
                     central: Any = None) -> Claim | None:
    """The claim covering the observation's membership attack, or None (no DP, or not
    covered: under central DP only attacks on the released model are)."""
    if cfg.privacy.dp == "local":
        if obs.client is not None:
            return local_claim({**obs.disclosed, "partition-id": obs.client})
        record = {r.round: r for r in ledger}.get(obs.round)
        claims = [c for c in (local_claim(x) for x in (record.clients if record else []))
                  if c is not None]
        # every member is bounded by its own client's curve: the weakest bounds them all
        return max(claims, key=lambda c: c.epsilon) if claims else None
    if cfg.privacy.dp == "central" and central is not None:
        params, releases = central
        if not releases:
            return None
        from dp_accounting import SelfComposedDpEvent

        from privacy.dp.dpfedavg import CentralAccountant

        eps = CentralAccountant(params).record_epsilon_after(releases)
        matrix = params.matrix
        if matrix is not None:  # the whole release as one mechanism (correlated noise)
            event = matrix.record_event(params.noise_multiplier * params.slack_factor,
                                        releases)
            return Claim(eps, params.target_delta,
                         f"{params.mechanism} noise over {releases} round(s) of cyclic "
                         "groups, record-level (sensitivity 2C in each of the client's "
                         "rounds, no amplification)", pld_profile(event))
        return Claim(eps, params.target_delta,
                     f"DP-FedAvg's {releases} release(s), record-level (sensitivity 2C, no "
                     "amplification)",
                     pld_profile(SelfComposedDpEvent(params.record_event(), releases)))
    return None


# Which membership variants attack the released model (what central DP covers).
RELEASED = ("global-loss", "global-loss-drop")
