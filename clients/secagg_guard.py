"""The client's checks around Flower's SecAgg+ mod against an active server.

Flower's ``secaggplus_mod`` follows the protocol for an honest-but-curious server. Against
a server that deviates, a client also needs to check (Bell et al. 2020, Sec. 4, the
malicious-server variant's consistency conditions; what Flower's client omits):

* at setup: ``2 * threshold > num_shares``, so the server cannot get a threshold of
  shares of one client's self-mask seed from some neighbours and a threshold of shares of
  its secret key from others (which together unmask that client's vector alone);
* at unmask: the client itself is not declared dropped (it would hand over a share of its
  own secret key), no node is both alive and dropped, and the survivors named agree with
  its contribution record (:mod:`clients.contributions`: a second unmasking of the same
  update must name the same survivors).

:func:`check` runs before ``secaggplus_mod`` (the ClientApp's guard mod);
:func:`masking_cohort` tells the training handler whom its vector is masked with (its
neighbours that sent their shares, and itself).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)

from tasks.config import validate
from tasks.seeding import derive_seed

from . import contributions
from .update import Client

PENDING = "fedpriv.secagg-pending"  # Context.state: the digest of the update being masked


def masking_cohort(msg: Message, context: Context) -> tuple[int, list[int]]:
    """(own node id, the node ids this round's vector is masked with, itself included),
    read while ``secaggplus_mod`` is in its collect stage."""
    state = context.state.config_records[RECORD_KEY_STATE]
    own = int(state["nid"])
    sources = msg.content.config_records[RECORD_KEY_CONFIGS].get(Key.SOURCE_LIST, [])
    return own, sorted({own, *(int(s) for s in sources)})


def claim(msg: Message, context: Context, client: Client, arrays: list[np.ndarray],
          server_round: int, simulated: bool) -> tuple[int | None, int]:
    """Claim this model for the cohort the vector is masked with (refusing when the
    contribution record forbids it, :mod:`clients.contributions`), before training.
    Returns the training's seed (None: the round's public one) and the seed of SecAgg+'s
    stochastic rounding."""
    seeded = derive_seed(client.cfg.training.seed, server_round, client.partition_id, 7)
    on, radius = contributions.settings(client.cfg.secagg.contribution_record,
                                        client.cfg.secagg.contribution_radius,
                                        context.node_config, simulated)
    if not on:
        return None, seeded
    _, masked_with = masking_cohort(msg, context)
    record = contributions.load(context, radius, simulated)
    # a simulated run stays reproducible (the run's seeds) unless it asks for secure-rng
    public = simulated and not client.cfg.privacy.secure_rng
    entry = record.claim(arrays, masked_with, "secagg+", server_round,
                         client.round_seed(server_round) if public else None)
    contributions.save(context, record, simulated)  # before anything leaves the client
    context.state[PENDING] = ConfigRecord({"digest": entry.digest})
    rounding = derive_seed(client.cfg.training.seed, entry.rounds[0], client.partition_id, 7) \
        if public else derive_seed(entry.seed, 7)
    return entry.seed, rounding


def check(msg: Message, context: Context, simulated: bool) -> None:
    """Refuse a setup whose threshold lets shares be split, and an unmask request that
    names this client dropped, a node both ways, or survivors its record forbids (raises
    :class:`clients.contributions.ContributionRefused`)."""
    configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    cfg = validate(context.run_config)
    on, radius = contributions.settings(cfg.secagg.contribution_record,
                                        cfg.secagg.contribution_radius, context.node_config,
                                        simulated)
    if configs is None or not on:
        return
    stage = configs.get(Key.STAGE)
    if stage == Stage.SETUP:
        shares, threshold = int(configs[Key.SHARE_NUMBER]), int(configs[Key.THRESHOLD])
        if 2 * threshold <= shares:
            raise contributions.ContributionRefused(
                f"SecAgg+ setup with reconstruction threshold {threshold} of {shares} shares: "
                "a server could collect a threshold of shares of one client's mask seed and "
                "another threshold of its secret key, and unmask it alone. This client needs "
                "2 * threshold > num-shares (secagg-reconstruction-threshold).")
    elif stage == Stage.UNMASK:
        own = int(context.state.config_records[RECORD_KEY_STATE]["nid"])
        active = [int(n) for n in configs[Key.ACTIVE_NODE_ID_LIST]]
        dead = [int(n) for n in configs[Key.DEAD_NODE_ID_LIST]]
        if own in dead or own not in active:
            raise contributions.ContributionRefused(
                "the unmask request names this client dropped: it would hand over a share "
                "of its own secret key, letting its masked vector be opened alone")
        if set(active) & set(dead):
            raise contributions.ContributionRefused(
                f"the unmask request names {sorted(set(active) & set(dead))} both alive and "
                "dropped")
        pending = context.state.config_records.get(PENDING)
        if pending is not None:
            record = contributions.load(context, radius, simulated)
            record.reveal(str(pending["digest"]), active)
            contributions.save(context, record, simulated)
