"""The ClientApp: a handler per named action (tasks.messages), each only unpacking and packing.

The same app runs in Flower's simulation runtime (one Ray actor serves many clients
in turn) and on a real SuperNode started with
``--node-config "partition-id=I num-partitions=N"``. Flower routes each message by
its type to the handler registered for it; SecAgg+'s mod applies to the secure round's
handler only, and the disclosure mod to every reply.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import (
    Code,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)

from privacy.dp import distributed
from privacy.dp.disclosure import policy
from tasks import messages, model_pool
from tasks.config import validate
from tasks.distributed_dp import plan_for
from tasks.encrypted_updates import cohort_of
from tasks.encrypted_updates import from_record as signed_updates
from tasks.records import array_record, state_dict
from tasks.training import evaluate, resolve_device

from . import contributions, encrypted, secagg_guard
from .anonymized import federated_cvae_release, federated_cvae_round
from .host_config import flat_config, host_run_config
from .local_dp import load_ledger
from .state_store import TRANSIENT, state_file, state_mod
from .update import Client, as_update, local_update

LEGACY_METRICS = "fitres.metrics"  # Flower's legacy FitRes layout (SecAgg+ rounds)
LEGACY_NUM_EXAMPLES = "fitres.num_examples"


def disclosure_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Send only what the run's disclosure policy allows (:mod:`privacy.dp.disclosure`).

    The outermost mod, so it sees every reply as it leaves the client: each MetricRecord
    is filtered, and so are the metrics of the legacy FitRes layout SecAgg+ uses, whose
    clear ``num_examples`` is zeroed when the record count is not to be disclosed (the
    SecAgg+ weight itself travels masked, inside the secure sum).
    """
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    cfg = validate(context.run_config)
    rule = policy(cfg.privacy.dp, cfg.secagg.enabled, cfg.privacy.report_client_metrics)
    if not rule.restricted:
        return reply
    content = reply.content
    for name, record in list(content.metric_records.items()):
        if name == LEGACY_NUM_EXAMPLES:
            if not rule.permits("num-examples"):
                content.metric_records[name] = MetricRecord({"num_examples": 0})
            continue
        content.metric_records[name] = MetricRecord(rule.filter(record))
    if LEGACY_METRICS in content.config_records:
        content.config_records[LEGACY_METRICS] = ConfigRecord(
            rule.filter(content.config_records[LEGACY_METRICS]))
    return reply


_IN_PROCESS = False  # set by the in-process runtime (experiments.runtime.inprocess)


def serve_in_process() -> None:
    """Mark this process as the in-process runtime's: its nodes are simulated."""
    global _IN_PROCESS
    _IN_PROCESS = True


def in_simulation() -> bool:
    """True inside a simulation runtime: Flower's, whose ClientApps run in its Ray workers,
    or fedpriv's in-process one. Only there is a node a worker the server may pair with a
    partition and a state folder; a real SuperNode runs its ClientApp in a process of its
    own, without Ray."""
    if _IN_PROCESS:
        return True
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def answers_in_parallel(msg: Message, run_config: dict[str, Any]) -> bool:
    """Whether ``msg`` may be answered in a thread beside other clients' with the same
    result as alone: a plain training round draws from no process-wide generator (its
    batches and, with local DP-SGD, its noise from generators of its own; models without
    dropout). Anonymizers (fitted on first use, some from the global generators), audit
    canaries and train-together (its own meeting of threads) are answered one at a time;
    so is every other action (SecAgg+'s rounding draws from numpy's global generator)."""
    if msg.metadata.message_type != messages.FIT:
        return False
    config = {**flat_config(run_config),
              **dict(msg.content.config_records.get(messages.CELL_RECORD) or {})}
    cfg = validate({k: v for k, v in config.items() if k != "cell"})
    return (not cfg.anonymization.enabled
            and not cfg.resources.train_together
            and not (cfg.leakage.enabled and cfg.leakage.canaries))


def assignment_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Serve the partition and the sweep cell the server stamped on the message.

    In simulation the server pairs nodes with partitions (:mod:`strategies.grid`): its
    ``fedpriv.node`` record becomes this message's ``node_config``. A real SuperNode
    ignores that record: its partition, its data (``data-path``) and the folder it writes
    its state to (``state-dir``) are its host's choice, never the server's; so are where
    the shared dataset lives and whether to download it (the run config's ``data-dir``,
    ``download`` and ``backbone-weights`` are replaced by the node's own:
    :mod:`clients.host_config`). In a sweep run inside one simulation, ``fedpriv.cell``
    carries the cell's run-config keys: the handlers see
    that cell's run config, and a ``Context.state`` of that cell's own (its records are
    kept under a ``cell-<index>/`` prefix), so one cell's DP ledger or CVAE decoder is
    never another's. Both records are removed before any handler sees the message.
    """
    content = msg.content
    simulated = in_simulation()
    node = content.config_records.get(messages.NODE_RECORD)
    if node is not None and not simulated:
        node = None  # a real SuperNode's host decides what it serves and where it writes
    cell = content.config_records.get(messages.CELL_RECORD)
    if node is None and cell is None and simulated:
        return call_next(msg, context)
    if messages.NODE_RECORD in content.config_records or cell is not None:
        msg.content = RecordDict({k: v for k, v in content.items()
                                  if k not in (messages.NODE_RECORD, messages.CELL_RECORD)})
    run_config, prefix = flat_config(context.run_config), ""
    if cell is not None:
        values = dict(cell)
        prefix = f"cell-{values.pop('cell')}/"
        run_config.update(values)
    if not simulated:  # data location and downloading: the node's configuration only
        run_config = host_run_config(run_config, context.node_config)
    state = RecordDict({k[len(prefix):]: v for k, v in context.state.items()
                        if k.startswith(prefix)}) if prefix else context.state
    view = Context(run_id=context.run_id, node_id=context.node_id,
                   node_config={**context.node_config, **(node or {})}, state=state,
                   run_config=run_config)
    reply = call_next(msg, view)
    if prefix:
        for name in [k for k in context.state if k.startswith(prefix)]:
            del context.state[name]
        for name, record in state.items():
            context.state[prefix + name] = record
    return reply


app = ClientApp(mods=[assignment_mod, state_mod, disclosure_mod])


def handles(message_type: str, **options: Any) -> Callable[[ClientAppCallable],
                                                         ClientAppCallable]:
    """Register a handler for ``message_type`` ('<category>' or '<category>.<action>', the
    constants of :mod:`tasks.messages` the ServerApp sends), as Flower's ``@app.<category>
    ("<action>")`` does, so both sides route by the same names."""
    category, _, action = message_type.partition(".")
    register = getattr(app, category)
    return register(action, **options) if action else register(**options)


def _reply(msg: Message, metrics: dict, arrays: ArrayRecord | None = None) -> Message:
    content = RecordDict({"metrics": MetricRecord(metrics)})
    if arrays is not None:
        content["arrays"] = arrays
    return Message(content, reply_to=msg)


@handles(messages.DESCRIBE)
def describe(msg: Message, context: Context) -> Message:
    """Report which partition this node holds, whether it is the host's own data and
    whether the node keeps its state for a resume, its size and label histogram."""
    client = Client.of(context)
    return _reply(msg, {"partition-id": client.partition_id,
                        "num-partitions": client.num_partitions,
                        "own-data": int(bool(context.node_config.get(messages.DATA_PATH))),
                        "accepts-trap-weights": int(bool(
                            context.node_config.get(messages.ACCEPT_TRAPS))),
                        "keeps-state": int(state_file(context.node_config,
                                                      context.run_config) is not None),
                        "num-examples": len(client.data),
                        "label-counts": client.data.label_counts()})


@handles(messages.STATE_CHECK)
def state_check(msg: Message, context: Context) -> Message:
    """On a resume: whether this client found its saved state for the run, and how many
    DP-SGD steps its ledger holds (the server refuses a resume that would reset them)."""
    client = Client.of(context)
    ledger = load_ledger(context)
    has = any(k not in TRANSIENT for k in context.state.keys())
    return _reply(msg, {"partition-id": client.partition_id, "has-state": int(has),
                        "dp-steps": ledger.steps if ledger is not None else 0})


@handles(messages.FIT)
def fit(msg: Message, context: Context) -> Message:
    """A plain training round: the global model in, the client's new model out."""
    client = Client.of(context)
    state = state_dict(msg.content["arrays"])
    new_state, metrics = local_update(client, context, state, msg.content["config"])
    return _reply(msg, metrics, None if new_state is None else array_record(new_state))


def secagg_guard_mod(msg: Message, context: Context, call_next: ClientAppCallable
                     ) -> Message:
    """A SecAgg+ client's checks against an active server (:mod:`clients.secagg_guard`),
    before Flower's mod acts on the message."""
    secagg_guard.check(msg, context, in_simulation())
    return call_next(msg, context)


@handles(messages.SECURE_FIT, mods=[secagg_guard_mod, secaggplus_mod])
def secure_fit(msg: Message, context: Context) -> Message:
    """A SecAgg+ round (Flower's workflow sends plain "train" in the legacy FitIns layout).

    The update (not the new weights) goes into the secure sum: its values are small, so
    SecAgg+'s [-r, r] range quantizes them finely, and clipping to [-r, r] never moves a
    zero, which keeps central DP's sensitivity bound (strategies.protocols.secagg).
    With the contribution record on, the client answers this model only for the cohort it
    answered it for before, if any (:mod:`clients.contributions`).
    """
    client = Client.of(context)
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    names = client.model_keys()
    old = parameters_to_ndarrays(fitins.parameters)
    server_round = int(fitins.config["server-round"])
    simulated = in_simulation()
    entry, rounding_seed = secagg_guard.claim(msg, context, client, old, fitins.config,
                                              simulated)
    secret_seed = None if entry is None else entry.seed
    state = {k: torch.from_numpy(np.array(a)) for k, a in zip(names, old, strict=True)}
    new_state, metrics = local_update(client, context, state, fitins.config, secret_seed)
    if entry is not None:
        contributions.ContributionRecord.check_replay(entry, new_state is None)
    update = as_update(new_state, old)
    if client.cfg.privacy.dp == "distributed":
        # the clipped, integer-encoded update plus this client's noise share, weight 1 (a
        # client that declined adds its noise share to a zero update)
        update, weight = [distributed_vector(client, update, server_round, secret_seed,
                                             simulated)], 1
    else:  # out of budget: weight 0 adds nothing to the secure sum
        weight = 0 if new_state is None else (
            1 if client.cfg.privacy.dp == "central" else int(metrics["num-examples"]))
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update),
                    weight, {k: v for k, v in metrics.items()
                             if isinstance(v, (int, float, str))})
    # Flower's mod then quantizes the update with stochastic rounding drawn from numpy's
    # global generator (the masks come from os.urandom): seeded per client and round in
    # simulation, so a secure run is reproducible in any runtime; from the contribution's
    # secret seed on a real SuperNode (a replay rounds alike)
    np.random.seed(rounding_seed)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


def distributed_vector(client: Client, update: list[np.ndarray], server_round: int,
                       seed: int | None, simulated: bool) -> np.ndarray:
    """This client's part of a distributed-DP sum (:mod:`privacy.dp.distributed`): its
    rounding and noise drawn from the contribution's seed (a replay to the same cohort sends
    the same vector, so no second noise sample is ever revealed), which is secret on a real
    SuperNode; in simulation the run's public seed unless ``secure-rng``."""
    flat = np.concatenate([np.asarray(u, dtype=np.float64).ravel() for u in update])
    plan = plan_for(client.cfg, flat.size)
    if seed is None and (client.cfg.privacy.secure_rng or not simulated):
        rng = distributed.secret_generator()
    else:
        seed = client.round_seed(server_round) if seed is None else seed
        rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, 0xD1])))
    return distributed.client_vector(flat, plan, distributed.sign_seed(
        client.cfg.training.seed, server_round), rng)


@handles(messages.CVAE_FIT)
def cvae_fit(msg: Message, context: Context) -> Message:
    """Phase 1 of the federated CVAE: train it locally, send back only the decoder."""
    client = Client.of(context)
    decoder, metrics = federated_cvae_round(client.cfg.anonymization, context, client.data,
                                            client.seed, msg.content["arrays"])
    return _reply(msg, {"partition-id": client.partition_id, **metrics}, decoder)


@handles(messages.CVAE_RELEASE)
def cvae_release(msg: Message, context: Context) -> Message:
    """End of phase 1: keep the final shared decoder, sample this client's release, score it."""
    client = Client.of(context)
    released = federated_cvae_release(client.cfg.anonymization, context, client.data,
                                      client.seed, msg.content["arrays"])
    return _reply(msg, {"partition-id": client.partition_id, **released.metrics()})


@handles(messages.HE_HELLO)
def he_hello(msg: Message, context: Context) -> Message:
    """HE key setup, step 1: this client's public key for the exchange."""
    client = Client.of(context)
    public, signing = encrypted.hello(context)
    reply = _reply(msg, {"partition-id": client.partition_id})
    reply.content[messages.HE_STATE] = ConfigRecord({"public-key": public,
                                                     "signing-key": signing})
    return reply


def _roster(asked: ConfigRecord) -> dict[int, bytes]:
    """The roster of signing keys the server relayed (partition id -> Ed25519 key)."""
    return {int(p): bytes(k) for p, k in zip(asked["roster-partitions"], asked["roster-keys"],
                                             strict=True)}


@handles(messages.HE_DEAL)
def he_deal(msg: Message, context: Context) -> Message:
    """HE key setup, step 2 (the dealer): the public context, and the secret sealed for each."""
    client = Client.of(context)
    asked = msg.content.config_records[messages.HE_STATE]
    public, sealed = encrypted.deal(context, client.partition_id,
                                    [int(p) for p in asked["partitions"]],
                                    [bytes(k) for k in asked["public-keys"]], _roster(asked))
    reply = _reply(msg, {"partition-id": client.partition_id})
    reply.content[messages.HE_STATE] = ConfigRecord({"public-context": public,
                                                     "sealed": sealed})
    return reply


@handles(messages.HE_INSTALL)
def he_install(msg: Message, context: Context) -> Message:
    """HE key setup, step 3: open the key the dealer sealed for this client."""
    client = Client.of(context)
    asked = msg.content.config_records[messages.HE_STATE]
    encrypted.install(context, client.partition_id, bytes(asked["sealed"]), _roster(asked))
    return _reply(msg, {"partition-id": client.partition_id})


@handles(messages.HE_FIT)
def he_fit(msg: Message, context: Context) -> Message:
    """A round under HE: train, send the update encrypted and signed for this round and its
    decryptor (with the metrics the policy allows)."""
    client = Client.of(context)
    config = msg.content["config"]
    chunks, signature, metrics = encrypted.encrypted_update(
        client, context, msg.content["arrays"].to_torch_state_dict(), config, in_simulation())
    reply = _reply(msg, metrics)
    if chunks is not None:
        reply.content[messages.HE_STATE] = ConfigRecord({"ciphertexts": chunks,
                                                         "signature": signature})
    return reply


@handles(messages.HE_DECRYPT)
def he_decrypt(msg: Message, context: Context) -> Message:
    """As the round's decryptor: check the signed updates the server relayed (at least the
    minimum cohort of distinct clients), sum them here and decrypt the sum, once a round."""
    client = Client.of(context)
    asked = msg.content.config_records[messages.HE_STATE]
    values, counts = encrypted.decrypt_sum(client, context, int(asked["server-round"]),
                                           signed_updates(asked), int(asked["length"]),
                                           cohort_of(asked), in_simulation())
    return _reply(msg, {"partition-id": client.partition_id},
                  ArrayRecord({"sum": Array(values), "counts": Array(counts)}))


@handles(messages.EVALUATE)
def evaluate_local(msg: Message, context: Context) -> Message:
    """Evaluate the global model on this client's own data (a personalization view): its
    own test split where the dataset has one (natural clients), else its training rows."""
    client = Client.of(context)
    cfg = client.cfg
    data = client.evaluation_data()
    with model_pool.borrowed(cfg, state_dict(msg.content["arrays"])) as model:
        loss, acc = evaluate(model, client.features(data.x), data.y,
                             cfg.training.eval_batch_size, resolve_device(cfg.resources.device))
    return _reply(msg, {"num-examples": len(data), "partition-id": client.partition_id,
                        "eval-loss": loss, "eval-accuracy": acc})
