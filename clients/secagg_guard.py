"""The client's checks around Flower's SecAgg+ mod against an active server.

Flower's ``secaggplus_mod`` follows the protocol for an honest-but-curious server. Each
client also checks its own view of a round (what Flower's client omits):

* at setup: the quantization is the run's (clipping range, levels, modulus, and under
  distributed or central DP weight 1), so no client is given a finer grid whose digits
  stand apart in the sum; and ``2 * threshold > num_shares``, so the shares of this
  client's mask seed and of its key cannot both reach a threshold from disjoint
  neighbours;
* at unmask: the client itself is not declared dropped (it would hand over a share of its
  own secret key), no node is both alive and dropped, and the survivors named agree with
  its contribution record (:mod:`clients.contributions`: a second unmasking of the same
  update must name the same survivors).

These are per-client checks. Bell et al. 2020's malicious-server variant also needs a
signed roster and a consistency round (every survivor signs the survivor set), which
Flower lacks: a server can still give one client's neighbours inconsistent unmask views
and open that client's vector within one round (docs/PRIVACY.md).

:func:`check` runs before ``secaggplus_mod`` (the ClientApp's guard mod);
:func:`masking_cohort` tells the training handler whom its vector is masked with (its
neighbours that sent their shares, and itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)

from tasks.config import RunConfig, validate
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
          round_config: Mapping[str, Any], simulated: bool
          ) -> tuple[contributions.Entry | None, int]:
    """Claim this model for the cohort the vector is masked with (refusing when the
    contribution record forbids it, :mod:`clients.contributions`), before training.
    Returns the record's entry (None: the record is off; its seed is the training's) and
    the seed of SecAgg+'s stochastic rounding."""
    server_round = int(round_config["server-round"])
    seeded = derive_seed(client.cfg.training.seed, server_round, client.partition_id, 7)
    on, radius = contributions.settings(client.cfg.secagg.contribution_record,
                                        client.cfg.secagg.contribution_radius,
                                        context.node_config, simulated)
    if not on:
        return None, seeded
    _, masked_with = masking_cohort(msg, context)
    # a simulated run stays reproducible (the run's seeds) unless it asks for secure-rng
    public = simulated and not client.cfg.privacy.secure_rng
    with contributions.held(context, radius, simulated) as record:  # saved before training
        entry = record.claim(arrays, masked_with, "secagg+", server_round,
                             contributions.request_context(round_config, context.run_config),
                             client.round_seed(server_round) if public else None)
    context.state[PENDING] = ConfigRecord({"digest": entry.digest})
    rounding = derive_seed(client.cfg.training.seed, entry.rounds[0], client.partition_id, 7) \
        if public else derive_seed(entry.seed, 7)
    return entry, rounding


MODULUS = 2 ** 32  # the modulus fedpriv's SecAgg+ workflow sums in (Flower's default)


def expected_quantization(cfg: RunConfig) -> dict[str, float]:
    """The SecAgg+ settings every client of the run must be given: the run config's, or
    under distributed DP those that carry its integers unchanged, with weight 1."""
    if cfg.privacy.dp == "distributed":
        bits = cfg.privacy.distributed_bits
        return {Key.CLIPPING_RANGE: float(2 ** (bits - 1)), Key.TARGET_RANGE: 2 ** bits,
                Key.MOD_RANGE: MODULUS, Key.MAX_WEIGHT: 1.0}
    out = {Key.CLIPPING_RANGE: cfg.secagg.clipping_range,
           Key.TARGET_RANGE: cfg.secagg.quantization_range, Key.MOD_RANGE: MODULUS}
    if cfg.privacy.dp == "central":
        out[Key.MAX_WEIGHT] = 1.0
    return out


def check_quantization(configs: ConfigRecord, cfg: RunConfig) -> None:
    """Refuse a setup whose quantization differs from the run's: a server that gives one
    client a finer grid than the others (or another weight) can read that client's digits
    out of the sum's high bits."""
    for key, want in expected_quantization(cfg).items():
        got = configs.get(key)
        if got is None or float(got) != float(want):
            raise contributions.ContributionRefused(
                f"SecAgg+ setup with {key} = {got!r}, not the run's {want!r}: every client "
                "must quantize alike, or the sum's digits can separate one client's vector "
                "from the others'. Refusing the round.")


def check(msg: Message, context: Context, simulated: bool) -> None:
    """Refuse a setup whose threshold lets shares be split, and an unmask request that
    names this client dropped, a node both ways, or survivors its record forbids (raises
    :class:`clients.contributions.ContributionRefused`)."""
    configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    cfg = validate(context.run_config)
    on, radius = contributions.settings(cfg.secagg.contribution_record,
                                        cfg.secagg.contribution_radius, context.node_config,
                                        simulated)
    if configs is None:
        return
    stage = configs.get(Key.STAGE)
    if stage == Stage.SETUP:
        check_quantization(configs, cfg)
    if not on:
        return
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
            with contributions.held(context, radius, simulated) as record:
                record.reveal(str(pending["digest"]), active)
