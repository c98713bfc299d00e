"""Which runtime carries a run: the fastest that gives the same results, Ray one key away.

``runtime = "auto"`` (the default) picks the in-process runtime
(:mod:`experiments.runtime.inprocess`): no SuperLink, no Ray, the same ServerApp and
ClientApp, the same ledger for the same seed. Ray (Flower's simulation runtime) is
chosen when the run needs what only it gives: a Ray cluster (``ray-address``) or clients
sharing a GPU (``client-gpus`` below 1 on a CUDA machine, so several train at once).
``fedpriv run --supernodes`` always runs Flower's deployment runtime.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from tasks.config import ConfigError, RunConfig


@dataclass(frozen=True)
class Runtime:
    """The chosen runtime and, said in the run's output, why."""

    name: str  # inprocess | ray | deployment
    why: str


# What a run on real SuperNodes (`fedpriv run --supernodes`: Flower's deployment runtime,
# one process per node on this machine) cannot do: (applies, the one-paragraph refusal).
NOT_ON_SUPERNODES: tuple[tuple[Callable[[RunConfig], bool], Callable[[RunConfig], str]], ...] = (
    (lambda cfg: cfg.resources.runtime == "inprocess",
     lambda cfg: "runtime = 'inprocess' with --supernodes: real SuperNodes run Flower's "
                 "deployment runtime, one process per node. Drop --supernodes to run "
                 "in-process, or set runtime = 'auto' to run on SuperNodes."),
    (lambda cfg: cfg.resources.runtime == "ray",
     lambda cfg: "runtime = 'ray' with --supernodes: real SuperNodes run Flower's "
                 "deployment runtime, one process per node, not the simulation runtime "
                 "(Ray). Drop --supernodes to run on Ray, or set runtime = 'auto' to run "
                 "on SuperNodes."),
    (lambda cfg: bool(cfg.resources.ray_address),
     lambda cfg: f"ray-address = {cfg.resources.ray_address!r} with --supernodes: the "
                 "SuperNodes run on this machine, not on the Ray cluster, which would not "
                 "be used. Drop --supernodes to run on the cluster, or leave ray-address "
                 "empty to run on SuperNodes."),
    (lambda cfg: cfg.resources.train_together,
     lambda cfg: "train-together = true with --supernodes: a round's clients can be "
                 "trained as one batched program only in the in-process runtime, and each "
                 "SuperNode trains its own client in its own process. Set train-together = "
                 "false to run on SuperNodes, or drop --supernodes to train them together "
                 "in-process."),
)


def choose(cfg: RunConfig, *, cuda: bool, supernodes: bool = False) -> Runtime:
    """The runtime for ``cfg`` on this machine, or a ConfigError naming what to choose."""
    r = cfg.resources
    shares = cuda and r.device != "cpu" and r.client_gpus < 1
    if supernodes:
        refused = [why(cfg) for applies, why in NOT_ON_SUPERNODES if applies(cfg)]
        if len(refused) == 1:
            raise ConfigError(refused[0])
        if refused:
            raise ConfigError("Invalid run config:\n  - " + "\n  - ".join(refused))
        return Runtime("deployment", "--supernodes: real SuperNodes on loopback")
    if r.runtime == "inprocess" and shares:
        raise ConfigError(
            f"runtime = 'inprocess' with client-gpus = {r.client_gpus}: the in-process "
            "runtime trains one client at a time on the whole GPU and cannot give clients "
            "shares of it. Set client-gpus = 1 to run in-process, or runtime = 'ray' to "
            "train several clients on the GPU at once.")
    if r.train_together and r.runtime != "inprocess" and (r.ray_address or shares):
        raise ConfigError(
            "train-together = true needs the in-process runtime, but this run would go to "
            "Ray (" + (f"ray-address = {r.ray_address}" if r.ray_address else
                       f"client-gpus = {r.client_gpus} on a CUDA machine") + "). Set "
            "runtime = 'inprocess' (with client-gpus = 1 on a GPU), or train-together = "
            "false.")
    if r.runtime == "inprocess":
        return Runtime("inprocess", "runtime = 'inprocess'")
    # why the run goes to Ray, and the in-process setting that would serve it instead
    instead = "set runtime = 'inprocess' and leave ray-address empty"
    if r.runtime == "ray":
        why = "runtime = 'ray'"
    elif r.ray_address:
        why = f"ray-address = {r.ray_address}"
    elif shares:
        why = f"client-gpus = {r.client_gpus} on a CUDA machine"
        instead = "set client-gpus = 1 (one client at a time on the whole GPU)"
    else:
        return Runtime("inprocess", "runtime = 'auto'")
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            f"this run needs Flower's simulation runtime ({why}), which runs on Ray, and Ray "
            "is not installed in this environment. Install fedpriv's dependencies (pip "
            "install -e . in the checkout, or pip install 'flwr[simulation]'), or run "
            f"in-process: {instead}.")
    return Runtime("ray", why)


def likely_inprocess(cfg: RunConfig, supernodes: bool = False) -> bool:
    """Whether the in-process runtime will likely serve ``cfg`` (before the pre-flight
    check says whether CUDA is there): its child can then start, and check the run, early."""
    try:
        return not supernodes and choose(cfg, cuda=False).name == "inprocess"
    except ConfigError:
        return False
