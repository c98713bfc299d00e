"""Which keys a run actually reads: a key set in a mode that ignores it is a mistake the
user should hear about (``target-epsilon = 5`` with ``dp = 'none'`` trains without DP).

Each rule says when a key has no effect: while another key holds one of some values
(:class:`Unless`), or while the chosen anonymizer does not read it (its params dataclass,
:data:`privacy.anonymize.registry.ANONYMIZERS`). Values a plugin registers are never
ruled out: a plugin's strategy may read ``proximal-mu``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from privacy.anonymize.registry import ANONYMIZERS

from .keys import Scalar
from .sections import SECTIONS, RunConfig


@dataclass(frozen=True)
class Unless:
    """The key has no effect while ``on`` is one of ``values``."""

    on: str
    values: tuple[str, ...]

    def idle(self, flat: Mapping[str, Scalar]) -> str | None:
        """Why the key does nothing in ``flat`` (None: it may act)."""
        value = flat[self.on]
        return f"{self.on} = {value!r}" if value in self.values else None


_LOCAL_ONLY = Unless("dp", ("none", "central"))
_CENTRAL_ONLY = Unless("dp", ("none", "local"))
_SECAGG_ONLY = Unless("secure-aggregation", ("off", "he"))
# Flower's strategies fedpriv registers, by what they read (a plugin's are never ruled out)
_PLAIN = ("fedavg", "fedmedian")

RULES: dict[str, Unless] = {
    "target-epsilon": _LOCAL_ONLY,
    "max-grad-norm": _LOCAL_ONLY,
    "dp-train-data": _LOCAL_ONLY,
    "grad-sample-mode": _LOCAL_ONLY,
    "noise-multiplier": Unless("dp", ("none",)),
    "central-clipping": _CENTRAL_ONLY,
    "clipping-norm": _CENTRAL_ONLY,
    "client-sampling": _CENTRAL_ONLY,
    "max-epsilon": _CENTRAL_ONLY,
    "max-noise-to-signal": _CENTRAL_ONLY,
    "secagg-num-shares": _SECAGG_ONLY,
    "secagg-reconstruction-threshold": _SECAGG_ONLY,
    "secagg-clipping-range": _SECAGG_ONLY,
    "secagg-quantization-range": _SECAGG_ONLY,
    "secagg-max-weight": _SECAGG_ONLY,
    "he-min-cohort": Unless("secure-aggregation", ("off", "secagg+")),
    "dirichlet-alpha": Unless("partitioner", ("iid", "shard", "pathological")),
    "min-partition-size": Unless("partitioner", ("iid", "shard", "pathological")),
    "shards-per-client": Unless("partitioner", ("iid", "dirichlet", "pathological")),
    "classes-per-client": Unless("partitioner", ("iid", "dirichlet", "shard")),
    "proximal-mu": Unless("strategy", (*_PLAIN, "fedadam", "fedavgm", "fedtrimmedavg")),
    "trim-beta": Unless("strategy", (*_PLAIN, "fedadam", "fedavgm", "fedprox")),
    "server-momentum": Unless("strategy", (*_PLAIN, "fedadam", "fedprox", "fedtrimmedavg")),
    "server-lr": Unless("strategy", (*_PLAIN, "fedprox", "fedtrimmedavg")),
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


def idle_keys(given: Mapping[str, Any], cfg: RunConfig) -> dict[str, str]:
    """Of the keys in ``given`` set to other than their default, those ``cfg`` ignores:
    key -> why (e.g. ``"dp = 'none'"``)."""
    flat = cfg.flat()
    defaults = {k.name: k.default for _, section in SECTIONS for k in section.keys()}
    chosen = str(flat["anonymizer"])
    # an anonymizer's parameters, when the chosen one is registered and reads others
    foreign = (set().union(*(_anonymizer_keys(n) for n in ANONYMIZERS.names))
               - _anonymizer_keys(chosen)) if chosen in ANONYMIZERS else set()
    out: dict[str, str] = {}
    for name in given:
        if name not in flat or flat[name] == defaults[name]:
            continue
        rule = RULES.get(name)
        why = rule.idle(flat) if rule else None
        if why is None and name in foreign:
            why = f"anonymizer = {chosen!r}"
        if why is not None:
            out[name] = why
    return out


def describe_idle(idle: Mapping[str, str], given: Mapping[str, Any]) -> list[str]:
    """One sentence per idle key: what was set, why it does nothing, how to fix it."""
    keys = {k.name: k for _, section in SECTIONS for k in section.keys()}
    out = []
    for name, why in idle.items():
        rule = RULES.get(name)
        on = rule.on if rule else "anonymizer"
        choices = keys[on].choices
        inactive = rule.values if rule else ()
        active = [c for c in choices if c not in inactive] if choices and rule else []
        fix = (f"set {on} = {active[0]!r}" if len(active) == 1 else
               f"set {on} to one of {', '.join(active)}" if active else
               f"choose the {on} that reads it")
        out.append(f"{name} = {given[name]!r} has no effect with {why}: remove it, or {fix}.")
    return out
