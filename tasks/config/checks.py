"""Checks across keys: combinations that cannot work, each explained in one paragraph."""

from __future__ import annotations

import dataclasses

from privacy.anonymize.registry import ANONYMIZERS, raw_input_anonymizers
from privacy.attacks.registry import (
    ATTACKS,
    aggregate_attacks,
    attacks_scored_as,
    reference_attacks,
)
from privacy.dp.accounting import clients_per_round

from ..registry import DATASETS, MODELS
from .sections import AnonymizationConfig, RunConfig, parse_hidden, parse_sigmas
from .study import LeakageConfig

TRAP_READER = "imprint"  # the attack server.tamper builds its trap weights for


def cross_checks(cfg: RunConfig) -> list[str]:
    errors = []
    fed = cfg.federation
    if fed.min_train_clients > fed.num_clients:
        errors.append(
            f"min-train-clients = {fed.min_train_clients} is larger than num-clients = "
            f"{fed.num_clients}: the server would wait forever for clients that do not "
            "exist. Lower min-train-clients or raise num-clients.")
    errors += _data_checks(cfg)
    errors += _local_steps_checks(cfg)
    errors += _privacy_checks(cfg)
    errors += _mechanism_checks(cfg)
    errors += _secagg_checks(cfg)
    errors += _embedding_checks(cfg)
    errors += _leakage_checks(cfg)
    ray = cfg.resources.ray_address
    host, _, port = ray.rpartition(":")
    if ray and (not host or not port.isdigit() or not 0 < int(port) < 65536):
        errors.append(f"ray-address = {ray!r} is not HOST:PORT: give the Ray head's address "
                      "as `ray start --head --port 6379` prints it, e.g. 10.0.0.5:6379.")
    errors += _together_checks(cfg)
    if ray and cfg.resources.runtime == "inprocess":
        errors.append(f"ray-address = {ray!r} with runtime = 'inprocess': the in-process "
                      "runtime trains every client in fedpriv's own process and cannot use a "
                      "Ray cluster. Set runtime = 'ray' (or 'auto') to run on the cluster, "
                      "or leave ray-address empty to run in-process.")
    try:
        parse_hidden(cfg.training.mlp_hidden)
    except ValueError as exc:
        errors.append(f"mlp-hidden = {cfg.training.mlp_hidden!r}: {exc}")
    try:
        parse_sigmas(cfg.training.test_noise)
    except ValueError as exc:
        errors.append(f"test-noise = {cfg.training.test_noise!r}: {exc}")
    return errors


LABEL_PARTITIONERS = ("dirichlet", "shard", "pathological")


def _local_steps_checks(cfg: RunConfig) -> list[str]:
    if cfg.training.local_steps > 0 and cfg.leakage.enabled:
        return [f"local-steps = {cfg.training.local_steps} with the leakage study "
                "(leakage-rounds): its attacks replay whole local epochs. Set local-steps = 0 "
                "or leave leakage-rounds empty."]
    return []


def _data_checks(cfg: RunConfig) -> list[str]:
    """The dataset, its partitioner and the model fit together (the registries' infos:
    nothing is read)."""
    d, errors = cfg.data, []
    if d.dataset not in DATASETS:
        return errors
    info = DATASETS.info(d.dataset)
    natural = [n for n in DATASETS.names if DATASETS.info(n).natural]
    if d.partitioner == "natural" and not info.natural:
        errors.append(f"partitioner = 'natural' splits a dataset by the client each row names "
                      f"(a speaking role, a writer), and {d.dataset} names none. Use it with "
                      f"{', '.join(natural)}, or split {d.dataset} with iid, dirichlet, shard "
                      "or pathological.")
    if info.natural and d.partitioner in LABEL_PARTITIONERS:
        errors.append(f"partitioner = {d.partitioner!r} invents label-skewed clients, but "
                      f"{d.dataset}'s clients are its own (its rows name them): use "
                      "partitioner = 'natural' (or 'iid' for an i.i.d. baseline over the same "
                      "rows).")
    model = cfg.training.model
    if model != "auto" and model in MODELS and not cfg.embeddings.enabled and \
            info.kind not in MODELS.info(model).reads:
        fits = [m for m in MODELS.names if info.kind in MODELS.info(m).reads]
        errors.append(f"model = {model!r} cannot read {d.dataset} ({info.kind} data): use "
                      f"{', '.join(fits)} or 'auto'.")
    mem = cfg.memorization
    if mem.enabled and info.kind != "text":
        texts = [n for n in DATASETS.names if DATASETS.info(n).kind == "text"]
        errors.append(f"secret-canaries plants canary lines in clients' text, and {d.dataset} "
                      f"is {info.kind} data: use it with {', '.join(texts)}, or set "
                      "secret-canaries = 0 (for images, the audit's canaries are "
                      "`canaries`).")
    if mem.enabled:
        try:
            mem.repetitions()
        except ValueError as exc:
            errors.append(f"secret-repetitions = {mem.secret_repetitions!r}: {exc}.")
        if mem.secret_canaries > 10 ** mem.secret_length:
            errors.append(f"secret-canaries = {mem.secret_canaries} distinct secrets of "
                          f"secret-length = {mem.secret_length} digits do not exist (10^"
                          f"{mem.secret_length} of them): lengthen the secret or plant fewer.")
        if mem.secret_clients > cfg.federation.num_clients:
            errors.append(f"secret-clients = {mem.secret_clients} is more than num-clients = "
                          f"{cfg.federation.num_clients}: lower it.")
    if d.partitioner == "natural" and (cfg.embeddings.enabled or
                                       cfg.leakage.reference_fraction > 0):
        errors.append("partitioner = 'natural' with rows held back from the clients (a "
                      "backbone's public split, reference-fraction): the held-back rows would "
                      "be taken from every client's own. Use features = 'raw' and "
                      "reference-fraction = 0 with natural clients.")
    if info.kind == "text":
        recurrent = cfg.training.model in ("auto", "char-gru", "char-lstm")  # auto: GRU
        if (cfg.privacy.dp == "local" and cfg.privacy.grad_sample_mode == "ghost"
                and recurrent):
            errors.append("grad-sample-mode = 'ghost' cannot train recurrent layers (Opacus' "
                          "DPLSTM/DPGRU reuse a layer at every step, which its ghost clipping "
                          "assumes never happens). Use grad-sample-mode = 'bookkeeping', "
                          "'hooks' or 'auto'.")
        if cfg.embeddings.enabled:
            errors.append(f"features = 'embeddings' builds image or tabular embeddings; "
                          f"{d.dataset} is text. Use features = 'raw'.")
        if cfg.anonymization.enabled:
            errors.append(f"anonymizer = {cfg.anonymization.anonymizer!r} anonymizes images "
                          f"or embeddings; {d.dataset} is text. Use anonymizer = 'none'.")
        if cfg.leakage.enabled:
            errors.append(f"the leakage study's attacks (leakage-rounds) reconstruct images "
                          f"and labels; {d.dataset} is text. Leave leakage-rounds empty.")
    return errors


def _privacy_checks(cfg: RunConfig) -> list[str]:
    errors = []
    p, strategy = cfg.privacy, cfg.federation.strategy
    if p.dp == "local":
        if p.target_epsilon == 0 and p.noise_multiplier == 0:
            errors.append("dp = 'local' with noise-multiplier = 0 and no target-epsilon gives "
                          "no privacy (epsilon is infinite). Set target-epsilon (e.g. 5) or a "
                          "positive noise-multiplier, or use dp = 'none'.")
        if p.dp_relation == "replace-one" and p.accountant != "pld":
            errors.append(f"dp-relation = 'replace-one' with accountant = {p.accountant!r}: "
                          "Opacus' accountants analyse add/remove neighbours only, so that "
                          "epsilon would not be a replace-one guarantee. Use accountant = "
                          "'pld' (dp-accounting's replace-one analysis), or dp-relation = "
                          "'add-remove'.")
        if p.dp_relation == "replace-one" and p.public_records:
            errors.append(f"dp-public-records = {p.public_records} with dp-relation = "
                          "'replace-one': under replace-one neighbours share their record "
                          "count, so each client's schedule comes from its own n and no "
                          "public size is used. Remove dp-public-records, or use dp-relation "
                          "= 'add-remove'.")
        if strategy == "fedprox":
            errors.append("strategy = 'fedprox' with dp = 'local' is not supported: Opacus "
                          "replaces each gradient by the clipped, noised per-sample sum, so "
                          "the proximal term would be silently dropped. Use fedavg.")
    if p.dp == "central":
        if strategy != "fedavg":
            errors.append(f"dp = 'central' needs strategy = 'fedavg' (got {strategy!r}): the "
                          "noise is calibrated to an unweighted mean of clipped updates.")
        if p.accountant == "prv":
            errors.append("accountant = 'prv' is Opacus' accountant for DP-SGD; central "
                          "DP-FedAvg is accounted with dp-accounting. Use accountant = 'pld' "
                          "(the default, tightest) or 'rdp'.")
        if p.noise_multiplier == 0 and not p.target_epsilon:
            errors.append("dp = 'central' with noise-multiplier = 0 adds no noise (epsilon is "
                          "infinite). Use a positive noise-multiplier, e.g. 1.0.")
    if p.client_sampling == "poisson" and p.dp != "distributed":
        if p.dp != "central":
            errors.append("client-sampling = 'poisson' is for dp = 'central', where it gives "
                          "amplification by sampling; other modes sample a fixed cohort. Use "
                          "client-sampling = 'fixed' or dp = 'central'.")
        elif cfg.secagg.enabled:
            errors.append("client-sampling = 'poisson' with secure-aggregation is not "
                          "supported: a Poisson round can sample fewer clients than SecAgg+ "
                          "needs, and skipping such rounds would depend on who was sampled "
                          "(a leak the accounting does not cover). Use client-sampling = "
                          "'fixed'.")
    restricted = p.dp == "local" or cfg.secagg.enabled
    if restricted and cfg.federation.fraction_evaluate > 0 and not p.report_client_metrics:
        why = "dp = 'local'" if p.dp == "local" else "secure-aggregation"
        errors.append(f"fraction-evaluate = {cfg.federation.fraction_evaluate} with {why}: "
                      "client evaluation sends each client's loss and accuracy on its own "
                      "data in the clear, which its epsilon does not cover and secure "
                      "aggregation does not hide. Set fraction-evaluate = 0 (the server still "
                      "evaluates on its test set), or report-client-metrics = true to accept "
                      "the disclosure (the summary will say so).")
    return errors


def _mechanism_checks(cfg: RunConfig) -> list[str]:
    """Central DP's mechanism across rounds and the participation it needs: correlated
    noise is private only if each client's rounds are far enough apart (cyclic groups)."""
    p, fed = cfg.privacy, cfg.federation
    mech, sampling, cyclic = p.central_mechanism, p.client_sampling, \
        p.client_sampling.startswith("cyclic")
    if p.dp != "central":
        out = []
        if mech != "gaussian":
            out.append(f"central-mechanism = {mech!r} with dp = {p.dp!r}: it is the noise "
                       "central DP adds across rounds. Set dp = 'central', or drop "
                       "central-mechanism.")
        if cyclic:
            out.append(f"client-sampling = {sampling!r} with dp = {p.dp!r}: cyclic groups are "
                       "central DP's participation schedule. Set dp = 'central', or "
                       "client-sampling = 'fixed'.")
        return out
    errors = []
    rounds, n = fed.num_server_rounds, fed.num_clients
    if mech != "gaussian" and not cyclic:
        errors.append(
            f"central-mechanism = {mech!r} with client-sampling = {sampling!r}: correlated "
            "noise is private only if no client takes part twice within the rounds its noise "
            f"is correlated over, which {sampling} sampling cannot promise. Set "
            "client-sampling = 'cyclic' (or 'cyclic-poisson' for banded-mf) with "
            "cyclic-groups, or central-mechanism = 'gaussian'.")
    if cyclic and not 1 <= p.cyclic_groups <= min(rounds, n):
        errors.append(
            f"client-sampling = {sampling!r} with cyclic-groups = {p.cyclic_groups}: the "
            f"groups must number between 1 and min(num-server-rounds, num-clients) = "
            f"{min(rounds, n)}, so that every group trains and has clients. Set "
            "cyclic-groups (e.g. the mf-bands you want).")
    if sampling == "cyclic" and fed.fraction_train < 1:
        errors.append(
            f"client-sampling = 'cyclic' with fraction-train = {fed.fraction_train}: a cyclic "
            "round trains its whole group. Use client-sampling = 'cyclic-poisson' to sample "
            "within the group at that rate, or fraction-train = 1.")
    if mech in ("tree", "blt") and sampling == "cyclic-poisson":
        errors.append(
            f"central-mechanism = {mech!r} with client-sampling = 'cyclic-poisson': its "
            "accounting claims no amplification by sampling (amplification by sampling "
            "needs a client's columns of the strategy not to overlap, which only banded-mf's "
            "are). Use client-sampling = 'cyclic', or banded-mf for amplified correlated "
            "noise.")
    bands = p.mf_bands or p.cyclic_groups
    if mech == "banded-mf" and cyclic and p.cyclic_groups >= 1 and bands > p.cyclic_groups:
        errors.append(
            f"mf-bands = {bands} with cyclic-groups = {p.cyclic_groups}: a client would take "
            f"part twice within {bands} rounds, where its noise is correlated, and the "
            f"sensitivity would exceed what is accounted. Use at most {p.cyclic_groups} "
            "bands, or more cyclic groups.")
    if mech == "banded-mf" and bands > rounds:
        errors.append(f"mf-bands = {bands} with num-server-rounds = {rounds}: the strategy "
                      f"has at most as many bands as rounds. Use at most {rounds}.")
    if p.mf_bands and mech != "banded-mf":
        errors.append(f"mf-bands = {p.mf_bands} with central-mechanism = {mech!r}: only "
                      "banded-mf has bands. Drop mf-bands, or set central-mechanism = "
                      "'banded-mf'.")
    if p.cyclic_groups and not cyclic:
        errors.append(f"cyclic-groups = {p.cyclic_groups} with client-sampling = "
                      f"{sampling!r}: only cyclic sampling has groups. Set client-sampling = "
                      "'cyclic', or drop cyclic-groups.")
    if (cyclic or mech != "gaussian") and p.central_clipping.endswith("adaptive"):
        errors.append(
            f"central-clipping = {p.central_clipping!r} with {sampling} sampling and "
            f"{mech} noise: adaptive clipping's noisy count is accounted per round for "
            "independent noise under fixed or Poisson sampling only. Use central-clipping = "
            "'server-fixed' or 'client-fixed'.")
    if sampling == "cyclic-poisson" and cfg.secagg.enabled:
        errors.append("client-sampling = 'cyclic-poisson' with secure-aggregation is not "
                      "supported, for the reason of 'poisson': a sampled round can be too "
                      "small for SecAgg+. Use client-sampling = 'cyclic'.")
    return errors


def _distributed_checks(cfg: RunConfig) -> list[str]:
    """dp = distributed: SecAgg+ (the noise is added inside its modular sum), fewer
    colluders than clients a round, noise, and FedAvg."""
    p, fed = cfg.privacy, cfg.federation
    if p.dp != "distributed":
        return []
    errors: list[str] = []
    if cfg.secagg.protocol != "secagg+":
        errors.append(
            "dp = 'distributed' needs secure-aggregation = 'secagg+' (got "
            f"{cfg.secagg.protocol!r}): each client adds only a share of the noise, so its "
            "update is private only inside a secure sum. Under 'he' every client holds the "
            "decryption key, so against the server with one client the other shares protect "
            "no one; that combination is not built. Set secure-aggregation = 'secagg+', or "
            "use dp = 'local' (noise each client adds alone).")
    cohort = clients_per_round(fed.num_clients, fed.fraction_train, fed.min_train_clients)
    if p.distributed_colluding >= cohort:
        errors.append(f"distributed-colluding = {p.distributed_colluding} with {cohort} "
                      "client(s) a round: the server and the colluders could subtract every "
                      "noise share. Assume fewer colluders (at most "
                      f"{cohort - 1}) or sample more clients a round.")
    if p.noise_multiplier <= 0:
        errors.append("dp = 'distributed' with noise-multiplier = 0 adds no noise. Use a "
                      "positive noise-multiplier, e.g. 1.0.")
    if cfg.federation.strategy != "fedavg":
        errors.append("dp = 'distributed' needs strategy = 'fedavg': the noise is calibrated "
                      "to a sum of clipped updates.")
    if p.client_sampling == "poisson":
        errors.append("client-sampling = 'poisson' with dp = 'distributed': no amplification "
                      "is claimed against a server that picks the cohorts. Use "
                      "client-sampling = 'fixed'.")
    if cohort.bit_length() > 32 - p.distributed_bits:  # cohort * 2^bits < 2^32
        errors.append(f"distributed-bits = {p.distributed_bits} with {cohort} clients a round: "
                      "SecAgg+ sums in 32 bits, so clients x 2^bits must stay below 2^32. Use "
                      f"at most {32 - cohort.bit_length()} bits.")
    return errors


def _secagg_checks(cfg: RunConfig) -> list[str]:
    errors: list[str] = _distributed_checks(cfg)
    s, dp = cfg.secagg, cfg.privacy.dp
    if not s.enabled:
        return errors
    if cfg.federation.strategy != "fedavg":
        errors.append(f"secure-aggregation needs strategy = 'fedavg' (got "
                      f"{cfg.federation.strategy!r}): SecAgg+ and HE reveal only the weighted sum "
                      "of the updates.")
    if dp == "central" and cfg.privacy.central_clipping.startswith("server"):
        errors.append("secure-aggregation with dp = 'central' needs client-side clipping "
                      "(central-clipping = 'client-fixed'): the server cannot clip updates it "
                      "cannot see.")
    if dp == "central" and cfg.privacy.central_clipping == "client-adaptive":
        errors.append("secure-aggregation supports central-clipping = 'client-fixed' only "
                      "(adaptive clipping needs each client's clipping bit in the clear).")
    if s.reconstruction_threshold > s.num_shares:
        errors.append("secagg-reconstruction-threshold must not exceed secagg-num-shares.")
    fed = cfg.federation
    cohort = clients_per_round(fed.num_clients, fed.fraction_train, fed.min_train_clients)
    p = cfg.privacy
    if dp == "central" and p.client_sampling == "cyclic" and p.cyclic_groups >= 1:
        cohort = fed.num_clients // p.cyclic_groups  # the smallest group
    if s.he and cohort < s.he_min_cohort:
        how = (f"cyclic-groups = {p.cyclic_groups}" if p.client_sampling == "cyclic" and
               dp == "central" else f"fraction-train = {fed.fraction_train} and "
               f"min-train-clients = {fed.min_train_clients}")
        errors.append(f"secure-aggregation = 'he' with num-clients = {fed.num_clients}, "
                      f"{how} samples {cohort} client(s) a round, fewer than "
                      f"he-min-cohort = {s.he_min_cohort}: the clients would refuse to decrypt "
                      "every round (a sum that small could be one client's update). Raise "
                      f"fraction-train or min-train-clients to {s.he_min_cohort} or more (with "
                      "cyclic sampling, use fewer groups).")
    return errors


def _embedding_checks(cfg: RunConfig) -> list[str]:
    errors = []
    a, emb = cfg.anonymization, cfg.embeddings
    raw = raw_input_anonymizers()
    if a.enabled and not emb.enabled and a.anonymizer not in raw:
        errors.append(f"anonymizer = {a.anonymizer!r} anonymizes embeddings: set features = "
                      f"'embeddings' (on raw inputs only {', '.join(sorted(raw))} run), "
                      "or anonymizer = 'none'.")
    keys = {f.name for f in dataclasses.fields(AnonymizationConfig)}
    params = ANONYMIZERS.info(a.anonymizer).params
    unknown = [f.name for f in dataclasses.fields(params) if f.name not in keys]
    if unknown:
        errors.append(f"anonymizer = {a.anonymizer!r} reads {unknown}, which are not keys of "
                      "the anonymization section: the fields of an anonymizer's params "
                      "dataclass must be those keys (e.g. noise_scale for noise-scale), so "
                      "that the run config sets them. Fix its registration.")
    if emb.enabled and cfg.training.model not in ("auto", "mlp", "linear"):
        errors.append(f"with features = 'embeddings' the model is a head on the embeddings: "
                      f"use model = 'mlp', 'linear' or 'auto' (got {cfg.training.model!r}).")
    if a.anonymizer == "cvae-online" and cfg.privacy.dp == "local":
        errors.append("anonymizer = 'cvae-online' with dp = 'local' is not supported: DP-SGD "
                      "is accounted over a fixed dataset, and this one is resampled every "
                      "epoch. Use anonymizer = 'cvae'.")
    if a.anonymizer == "cvae-online" and cfg.leakage.enabled:
        errors.append("anonymizer = 'cvae-online' with the leakage study is not supported: "
                      "what a client trains on changes every epoch, so membership has no "
                      "fixed ground truth. Use anonymizer = 'cvae'.")
    if a.anonymizer == "cvae-federated":
        if cfg.secagg.enabled:
            errors.append("anonymizer = 'cvae-federated' with secure-aggregation is not "
                          "supported.")
        if cfg.privacy.dp == "local":
            errors.append("anonymizer = 'cvae-federated' with dp = 'local' is not supported: "
                          "in phase 1 the clients share CVAE decoders trained on their data "
                          "without DP, which their DP-SGD epsilon does not cover. Use "
                          "anonymizer = 'cvae' (trained locally, optionally with "
                          "cvae-epsilon) or dp = 'none'.")
        if a.cvae_epsilon > 0:
            errors.append("cvae-epsilon (DP training of the CVAE) is available for anonymizer "
                          "= 'cvae'; the federated CVAE is trained without DP in fedpriv.")
    return errors


def _leakage_checks(cfg: RunConfig) -> list[str]:
    errors: list[str] = []
    lk, fed = cfg.leakage, cfg.federation
    try:
        rounds = lk.rounds(fed.num_server_rounds)
        bad = [r for r in rounds if not 1 <= r <= fed.num_server_rounds]
        if bad:
            errors.append(f"leakage-rounds = {lk.leakage_rounds!r}: rounds {bad} do not exist; "
                          f"use 1 to {fed.num_server_rounds}, 'all', or empty for none.")
    except ValueError:
        errors.append(f"leakage-rounds = {lk.leakage_rounds!r} is not a list of round numbers "
                      "(e.g. '1,5'), 'all', or empty.")
    try:
        clients = lk.clients(fed.num_clients)
        bad = [c for c in clients or [] if not 0 <= c < fed.num_clients]
        if bad:
            errors.append(f"leakage-clients = {lk.leakage_clients!r}: partitions {bad} do not "
                          f"exist; use 0 to {fed.num_clients - 1}, 'all' or 'aggregate'.")
    except ValueError:
        errors.append(f"leakage-clients = {lk.leakage_clients!r} is not a list of partition "
                      "ids (e.g. '0,3'), 'all' or 'aggregate'.")
        clients = []
    errors += _canary_client_checks(cfg)
    if not lk.enabled:
        if lk.canaries:
            errors.append("canaries are for the audit of observed rounds: set leakage-rounds "
                          "(e.g. '1') and add 'audit' to attacks, or canaries = 0.")
        if lk.server == "malicious":
            errors.append("server = 'malicious' tampers only with observed rounds, and "
                          "leakage-rounds is empty: name them (e.g. leakage-rounds = '1', "
                          "leakage-clients = 'aggregate', attacks = 'imprint').")
        return errors
    if clients == [] or not lk.attack_list():
        what = "leakage-clients" if clients == [] else "attacks"
        errors.append(f"leakage-rounds = {lk.leakage_rounds!r} with {what} empty: the study "
                      "would observe or attack nothing. Name clients (e.g. leakage-clients = "
                      "'0', 'all' or 'aggregate') and attacks, or leave leakage-rounds empty "
                      "to run without the leakage study.")
    if cfg.secagg.enabled and clients:
        errors.append(f"leakage-clients = {lk.leakage_clients!r} with secure-aggregation: the "
                      "server never sees one client's update, only the aggregate, so a "
                      "per-client attack is impossible. Use leakage-clients = 'aggregate'.")
    chosen = [a for a in lk.attack_list() if a in ATTACKS]  # unknown ones: reported by the key
    if clients is None:
        whole = aggregate_attacks()
        per_client = [a for a in chosen if a not in whole]
        if per_client:
            errors.append(f"attacks {per_client} need one client's update and how many "
                          f"examples made it; on the aggregate only {', '.join(whole)} "
                          "runs (leakage-clients = 'aggregate'). Remove them from attacks, "
                          "or observe clients (e.g. leakage-clients = '0').")
    errors += _reference_data(lk, chosen)
    errors += _malicious(cfg)
    audits = attacks_scored_as("audit")
    if any(a in audits for a in chosen) != (lk.canaries > 0):
        errors.append("the audit needs canaries and canaries need the audit: set both "
                      "attacks containing 'audit' and canaries > 0 (e.g. 100), or neither.")
    # attacks scored against the client's records, which then include its canaries
    mixed = [a for a in chosen if a in attacks_scored_as("labels", "reconstruction")]
    if lk.canaries and mixed:
        errors.append(f"canaries with attacks {mixed}: an audited client's update also holds "
                      "its canary rows, so reconstructions and label counts would be made "
                      "and scored for records that are not its data. Audit in a run of its "
                      "own (attacks = 'mia,audit'), or set canaries = 0.")
    return errors


def _canary_client_checks(cfg: RunConfig) -> list[str]:
    """The canary-client audit (privacy.attacks.canary_clients) audits central DP with
    Poisson or cyclic client sampling or every client every round."""
    n, p, fed = cfg.leakage.canary_clients, cfg.privacy, cfg.federation
    if not n:
        return []
    if p.dp != "central":
        return [f"canary-clients = {n} with dp = {p.dp!r}: canary clients audit central "
                "DP-FedAvg's client-level guarantee, which only dp = 'central' gives. Set "
                "dp = 'central' (with a noise-multiplier), or canary-clients = 0 (record "
                "canaries for local DP: canaries)."]
    errors = []
    if n < 3:
        errors.append(f"canary-clients = {n}: the audit fits its bounds to the cosines of at "
                      "least 3 canary clients and 3 held-out directions. Set canary-clients "
                      ">= 3 (hundreds to thousands audit tightly), or 0.")
    if p.client_sampling == "fixed" and fed.fraction_train < 1:
        errors.append(f"canary-clients = {n} with client-sampling = 'fixed' and "
                      f"fraction-train = {fed.fraction_train}: in a fixed-size cohort a canary "
                      "client would have to displace a real one, which the audit does not "
                      "model. Set client-sampling = 'poisson' (or fraction-train = 1), or "
                      "canary-clients = 0.")
    if cfg.leakage.server == "malicious":
        errors.append(f"canary-clients = {n} with server = 'malicious': the tampered rounds' "
                      "results are thrown away after the canaries were summed, so the audit "
                      "would count rounds the model never received. Audit in an honest run "
                      "(server = 'honest'), or set canary-clients = 0.")
    return errors


def _reference_data(lk: LeakageConfig, chosen: list[str]) -> list[str]:
    """The reference-model attacks need data of the server's own."""
    needs_data = [a for a in chosen if a in reference_attacks()]
    if needs_data and lk.reference_fraction <= 0:
        return [f"attacks {needs_data} train reference updates on the server's own "
                "auxiliary data, and reference-fraction = 0 keeps none. Set e.g. "
                "reference-fraction = 0.2 (that share of the training set is held back "
                "from every client), or remove them."]
    return []


def _malicious(cfg: RunConfig) -> list[str]:
    """What a malicious server's trap needs: a model it can tamper with, its own data."""
    lk = cfg.leakage
    if lk.server != "malicious":
        return []
    errors = []
    if cfg.embeddings.enabled:
        errors.append("server = 'malicious' sends trap weights that read the model's inputs "
                      "back (Fowl et al. 2022); with features = embeddings they are a frozen "
                      "backbone's outputs, not the records. Use raw inputs.")
    if lk.reference_fraction <= 0:
        errors.append("server = 'malicious' sets its traps from data of its own, and "
                      "reference-fraction = 0 keeps none: set e.g. reference-fraction = 0.1.")
    if cfg.federation.strategy != "fedavg":
        errors.append(f"server = 'malicious' with strategy = {cfg.federation.strategy!r}: the "
                      "discarded tampered round would still move its server-side state; use "
                      "strategy = 'fedavg'.")
    if TRAP_READER not in lk.attack_list():
        errors.append(f"server = 'malicious' sends trap weights in the observed rounds and "
                      f"throws their result away, but attacks = {lk.attacks!r} does not name "
                      f"{TRAP_READER!r}, the attack that reads the records out of the trap: "
                      "the rounds would be spent and nothing recovered. Add it (e.g. attacks "
                      f"= '{TRAP_READER}'), or set server = 'honest' for the honest-but-curious "
                      "attacks.")
    return errors


def _together_checks(cfg: RunConfig) -> list[str]:
    """train-together: what the batched program (tasks.cohort_training) does not do."""
    if not cfg.resources.train_together:
        return []
    unsupported = {
        "runtime = 'ray'": cfg.resources.runtime == "ray",
        "dp = 'local' (its noise would come from another generator than the sequential "
        "run's)": cfg.privacy.dp == "local",
        "strategy = 'fedprox' (the proximal term)": cfg.federation.strategy == "fedprox",
        f"secure-aggregation = {cfg.secagg.protocol!r} (its rounds train one client after "
        "another)": cfg.secagg.enabled,
        "audit canaries (their crafted gradients)": cfg.leakage.canaries > 0,
        "anonymizer = 'cvae-online' (samples drawn as it trains)":
            cfg.anonymization.anonymizer == "cvae-online",
        "local-steps (its batches are every epoch's)": cfg.training.local_steps > 0,
        f"client-optimizer = {cfg.training.client_optimizer!r} (the batched program runs "
        "SGD with momentum)": cfg.training.client_optimizer != "sgd",
        "a text dataset (torch.func has no batching rule for recurrent layers)":
            cfg.data.dataset in DATASETS and DATASETS.info(cfg.data.dataset).kind == "text",
    }
    bad = [what for what, on in unsupported.items() if on]
    if not bad:
        return []
    return [f"train-together = true with {'; '.join(bad)}: a round's clients can be trained "
            "as one batched program only in the in-process runtime, with plain SGD. Set "
            "train-together = false, or drop what it cannot do."]
