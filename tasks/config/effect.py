"""Which keys a run actually reads: a key set in a mode that ignores it is a mistake the
user should hear about (``target-epsilon = 5`` with ``dp = 'none'`` trains without DP).

Each rule says when a key has no effect: while another key holds one of some values
(:class:`Unless`), while another key is empty (:class:`Unset`: the leakage study's
settings without ``leakage-rounds``), while the model the run builds does not read it
(:class:`ModelIgnores`: ``mlp-hidden`` with a CNN), or while the chosen anonymizer does
not read it (its params dataclass, :data:`privacy.anonymize.registry.ANONYMIZERS`).
Values a plugin registers are never ruled out: a plugin's strategy may read
``proximal-mu``, a plugin's model ``mlp-hidden``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from privacy.anonymize.registry import ANONYMIZERS

from ..registry import DATASETS, MODELS, auto_model
from .keys import Key, Scalar
from .sections import SECTIONS, RunConfig
from .study import LeakageConfig, MemorizationConfig


class Rule(abc.ABC):
    """When a key has no effect, and what to set instead."""

    on: str  # the key whose value decides

    @abc.abstractmethod
    def idle(self, flat: Mapping[str, Scalar]) -> str | None:
        """Why the key does nothing in ``flat`` (None: it may act)."""

    @abc.abstractmethod
    def fix(self, keys: Mapping[str, Key]) -> str:
        """How to make it act (after "remove it, or ...")."""


@dataclass(frozen=True)
class Unless(Rule):
    """The key has no effect while ``on`` is one of ``values``."""

    on: str
    values: tuple[str, ...]

    def idle(self, flat: Mapping[str, Scalar]) -> str | None:
        value = flat[self.on]
        return f"{self.on} = {value!r}" if value in self.values else None

    def fix(self, keys: Mapping[str, Key]) -> str:
        active = [c for c in keys[self.on].choices or () if c not in self.values]
        return (f"set {self.on} = {active[0]!r}" if len(active) == 1 else
                f"set {self.on} to one of {', '.join(active)}" if active else
                f"choose the {self.on} that reads it")


@dataclass(frozen=True)
class Unset(Rule):
    """The key has no effect while ``on`` is empty (``what`` says what that means)."""

    on: str
    what: str
    example: str

    def idle(self, flat: Mapping[str, Scalar]) -> str | None:
        return f"{self.on} = '' ({self.what})" if not str(flat[self.on]).strip() else None

    def fix(self, keys: Mapping[str, Key]) -> str:
        return f"set {self.on} (e.g. {self.on} = {self.example!r})"


@dataclass(frozen=True)
class ModelIgnores(Rule):
    """The key has no effect while the model the run builds (``model``, with 'auto'
    resolved as the run resolves it) is registered as not reading ``hidden``."""

    on: str = "model"

    @staticmethod
    def built(flat: Mapping[str, Scalar]) -> str | None:
        """The model the run builds, or None where it is known only once the data is."""
        model = str(flat["model"])
        if model != "auto":
            return model
        if flat["features"] == "embeddings":
            return auto_model((int(flat["embedding-dim"]),))
        dataset = str(flat["dataset"])
        shape = DATASETS.info(dataset).input_shape if dataset in DATASETS else None
        return auto_model(shape, DATASETS.info(dataset).kind) if shape is not None else None

    def idle(self, flat: Mapping[str, Scalar]) -> str | None:
        built = self.built(flat)
        if built is None or built not in MODELS or MODELS.info(built).reads_hidden:
            return None
        return (f"model = {built!r}" if built == flat["model"] else
                f"model = 'auto' ({built} for {flat['dataset']})")

    def fix(self, keys: Mapping[str, Key]) -> str:
        readers = [n for n, info in MODELS.items() if info.reads_hidden]
        return (f"set model = {readers[0]!r}" if len(readers) == 1 else
                f"set model to one of {', '.join(readers)}")


@dataclass(frozen=True)
class Zero(Rule):
    """The key has no effect while the count ``on`` is 0 (``example``: a count that acts)."""

    on: str
    example: int

    def idle(self, flat: Mapping[str, Scalar]) -> str | None:
        return f"{self.on} = 0" if flat[self.on] == 0 else None

    def fix(self, keys: Mapping[str, Key]) -> str:
        return f"set {self.on} > 0 (e.g. {self.on} = {self.example})"


@dataclass(frozen=True)
class AllOf(Rule):
    """The key has no effect while every one of ``rules`` says it has none (it acts as
    soon as one of them would let it)."""

    rules: tuple[Rule, ...]

    @property
    def on(self) -> str:  # type: ignore[override]
        return self.rules[0].on

    def idle(self, flat: Mapping[str, Scalar]) -> str | None:
        whys = [rule.idle(flat) for rule in self.rules]
        return None if any(w is None for w in whys) else " and ".join(
            w for w in whys if w is not None)

    def fix(self, keys: Mapping[str, Key]) -> str:
        return ", or ".join(rule.fix(keys) for rule in self.rules)


_LOCAL_ONLY = Unless("dp", ("none", "central", "distributed"))
_CENTRAL_ONLY = Unless("dp", ("none", "local", "distributed"))
_CLIENT_LEVEL = Unless("dp", ("none", "local"))  # central and distributed DP
_DISTRIBUTED_ONLY = Unless("dp", ("none", "local", "central"))
_SECAGG_ONLY = Unless("secure-aggregation", ("off", "he"))
# Flower's strategies fedpriv registers, by what they read (a plugin's are never ruled out)
_PLAIN = ("fedavg", "fedmedian")

# The leakage study's keys act only in observed rounds, except those that act in every
# round or that a cross-check explains better (tasks.config.checks): server, canaries;
# reference-fraction (the server's data is held back from every client either way);
# prune-update (a defence every client applies).
_OBSERVED = Unset("leakage-rounds", "no round is observed, so no attack runs", "1")
# canary-clients: the server's audit of central DP, in every round; audit-confidence
# serves it as well as the observed rounds' audit.
_ALWAYS = ("leakage-rounds", "server", "canaries", "canary-clients", "reference-fraction",
           "prune-update", "audit-confidence")

RULES: dict[str, Rule] = {
    **{k.name: _OBSERVED for k in LeakageConfig.keys() if k.name not in _ALWAYS},
    **{k.name: Zero("secret-canaries", 6) for k in MemorizationConfig.keys()
       if k.name != "secret-canaries"},
    "server-trap": Unless("server", ("honest",)),
    "canary-clients": _CENTRAL_ONLY,
    "audit-confidence": AllOf((_OBSERVED, Zero("canary-clients", 1000))),
    "mlp-hidden": ModelIgnores(),
    "target-epsilon": Unless("dp", ("none", "distributed")),
    # DP-SGD's clipping norm, and the record canaries' norm whatever the dp mode
    "max-grad-norm": AllOf((_LOCAL_ONLY, Zero("canaries", 100))),
    "dp-train-data": _LOCAL_ONLY,
    "dp-relation": _LOCAL_ONLY,
    "dp-public-records": _LOCAL_ONLY,
    "grad-sample-mode": _LOCAL_ONLY,
    "noise-multiplier": Unless("dp", ("none",)),
    "central-clipping": _CENTRAL_ONLY,
    "clipping-norm": _CLIENT_LEVEL,
    "client-sampling": _CENTRAL_ONLY,
    "central-mechanism": _CENTRAL_ONLY,
    "cyclic-groups": AllOf((_CENTRAL_ONLY, Unless("client-sampling", ("fixed", "poisson")))),
    "mf-bands": AllOf((_CENTRAL_ONLY, Unless("central-mechanism", ("gaussian", "tree", "blt")))),
    "max-epsilon": _CENTRAL_ONLY,
    "max-noise-to-signal": _CLIENT_LEVEL,
    "distributed-bits": _DISTRIBUTED_ONLY,
    "distributed-colluding": _DISTRIBUTED_ONLY,
    "contribution-record": Unless("secure-aggregation", ("off",)),
    "contribution-radius": Unless("secure-aggregation", ("off",)),
    "secagg-num-shares": _SECAGG_ONLY,
    "secagg-reconstruction-threshold": _SECAGG_ONLY,
    "secagg-clipping-range": _SECAGG_ONLY,
    "secagg-quantization-range": _SECAGG_ONLY,
    "secagg-max-weight": _SECAGG_ONLY,
    "he-min-cohort": Unless("secure-aggregation", ("off", "secagg+")),
    "dirichlet-alpha": Unless("partitioner", ("iid", "shard", "pathological", "natural")),
    "min-partition-size": Unless("partitioner", ("iid", "shard", "pathological", "natural")),
    "shards-per-client": Unless("partitioner", ("iid", "dirichlet", "pathological",
                                                "natural")),
    "classes-per-client": Unless("partitioner", ("iid", "dirichlet", "shard", "natural")),
    "proximal-mu": Unless("strategy", (*_PLAIN, "fedadam", "fedavgm", "fedtrimmedavg")),
    "trim-beta": Unless("strategy", (*_PLAIN, "fedadam", "fedavgm", "fedprox")),
    "server-momentum": Unless("strategy", (*_PLAIN, "fedadam", "fedprox", "fedtrimmedavg")),
    "server-lr": Unless("strategy", (*_PLAIN, "fedprox", "fedtrimmedavg")),
    "momentum": Unless("client-optimizer", ("adam", "adamw")),
    "backbone": Unless("features", ("raw",)),
    "backbone-weights": Unless("features", ("raw",)),
    "backbone-data": Unless("features", ("raw",)),
    "public-fraction": Unless("features", ("raw",)),
    "embedding-dim": Unless("features", ("raw",)),
    "backbone-epochs": Unless("features", ("raw",)),
    "privacy-holdout": Unless("anonymizer", ("none",)),
    "tracking-experiment": Unless("tracking", ("none", "tensorboard")),
    "cvae-rounds": Unless("anonymizer", tuple(n for n in ANONYMIZERS.names
                                             if n != "cvae-federated")),
    "cvae-local-epochs": Unless("anonymizer", tuple(n for n in ANONYMIZERS.names
                                                   if n != "cvae-federated")),
}


def _anonymizer_keys(name: str) -> set[str]:
    params = ANONYMIZERS.info(name).params
    return {f.name.replace("_", "-") for f in dataclasses.fields(params)} if params else set()


def unread_keys(keys: Iterable[str], cfg: RunConfig) -> dict[str, str]:
    """Of ``keys``, those ``cfg``'s mode never reads, whatever their value: key -> why (e.g.
    ``"dp = 'none'"``). Frames and tables show such a key empty, not at its default."""
    flat = cfg.flat()
    chosen = str(flat["anonymizer"])
    # an anonymizer's parameters, when the chosen one is registered and reads others
    foreign = (set().union(*(_anonymizer_keys(n) for n in ANONYMIZERS.names))
               - _anonymizer_keys(chosen)) if chosen in ANONYMIZERS else set()
    out: dict[str, str] = {}
    for name in keys:
        if name not in flat:
            continue
        rule = RULES.get(name)
        why = rule.idle(flat) if rule else None
        if why is None and name in foreign:
            why = f"anonymizer = {chosen!r}"
        if why is not None:
            out[name] = why
    return out


def idle_keys(given: Mapping[str, Any], cfg: RunConfig) -> dict[str, str]:
    """Of the keys in ``given`` set to other than their default, those ``cfg`` ignores:
    key -> why (e.g. ``"dp = 'none'"``)."""
    flat = cfg.flat()
    defaults = {k.name: k.default for _, section in SECTIONS for k in section.keys()}
    return unread_keys((k for k in given if k in flat and flat[k] != defaults[k]), cfg)


def describe_idle(idle: Mapping[str, str], given: Mapping[str, Any]) -> list[str]:
    """One sentence per idle key: what was set, why it does nothing, how to fix it."""
    keys = {k.name: k for _, section in SECTIONS for k in section.keys()}
    out = []
    for name, why in idle.items():
        rule = RULES.get(name)
        fix = rule.fix(keys) if rule else "choose the anonymizer that reads it"
        out.append(f"{name} = {given[name]!r} has no effect with {why}: remove it, or {fix}.")
    return out
