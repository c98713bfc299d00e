"""What the in-process runtime imports before its client workers fork, beyond every run's
apps: the libraries the run's configs ask for.

A worker forked without them imports them itself, in its first round, each worker
again: Opacus (with the scipy statistics it loads) is about 2.8 s of CPU a worker, so a
local-DP run's first round took 4.4 s instead of 0.5 s on two workers; ``torch._dynamo``,
which building any ``torch.optim.Optimizer`` imports, 1.3 s (a plain client's SGD builds
none: :class:`tasks.training.FunctionalSGD`). The CLI names
them when it starts the runtime (:func:`needed`, from the configs; no torch here), so
they load while the pre-flight check runs; the runtime loads them again from the run's
own configs before forking (:func:`load`, once per process).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tasks.config import RunConfig


def _opacus() -> None:
    from privacy.dp.dpsgd import import_opacus

    import_opacus()


def _torch_optimizers() -> None:
    import torch._dynamo  # noqa: F401  (lazy in torch: the first Optimizer imports it)


def _builds_optimizers(cfg: RunConfig) -> bool:
    """Whether the run builds a ``torch.optim.Optimizer``: DP (Opacus wraps the clients'
    optimizer; the matrix mechanism fits its factors with L-BFGS), a client optimizer
    other than SGD, the CVAE anonymizers (Adam) and the malicious server's trap."""
    return (cfg.privacy.dp != "none" or cfg.training.client_optimizer != "sgd"
            or cfg.anonymization.anonymizer.startswith("cvae")
            or cfg.leakage.server == "malicious")


# name -> (whether a run config needs it, how to import it)
PRELOADS: dict[str, tuple[Callable[[RunConfig], bool], Callable[[], None]]] = {
    "opacus": (lambda cfg: cfg.privacy.dp == "local" or (
        cfg.anonymization.anonymizer.startswith("cvae")
        and cfg.anonymization.cvae_epsilon > 0), _opacus),
    "torch-optimizers": (_builds_optimizers, _torch_optimizers),
}


def needed(configs: Iterable[RunConfig]) -> list[str]:
    """The names in :data:`PRELOADS` that any of ``configs`` needs."""
    configs = list(configs)
    return [name for name, (wants, _) in PRELOADS.items() if any(wants(c) for c in configs)]


def load(names: Iterable[str]) -> None:
    """Import each named library (known names only; a repeat costs nothing)."""
    for name in names:
        if name in PRELOADS:
            PRELOADS[name][1]()
