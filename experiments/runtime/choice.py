"""Which runtime carries a run: the fastest that gives the same results, Ray one key away.

``runtime = "auto"`` (the default) picks the in-process runtime
(:mod:`experiments.runtime.inprocess`): no SuperLink, no Ray, the same ServerApp and
ClientApp, the same ledger for the same seed. Ray (Flower's simulation runtime) is
chosen when the run needs what only it gives: a Ray cluster (``ray-address``) or clients
sharing a GPU (``client-gpus`` below 1 on a CUDA machine, so several train at once).
``fedpriv run --supernodes`` always runs Flower's deployment runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.config import ConfigError, RunConfig


@dataclass(frozen=True)
class Runtime:
    """The chosen runtime and, said in the run's output, why."""

    name: str  # inprocess | ray | deployment
    why: str


def choose(cfg: RunConfig, *, cuda: bool, supernodes: bool = False) -> Runtime:
    """The runtime for ``cfg`` on this machine, or a ConfigError naming what to choose."""
    r = cfg.resources
    shares = cuda and r.device != "cpu" and r.client_gpus < 1
    if supernodes:
        if r.runtime == "inprocess":
            raise ConfigError(
                "runtime = 'inprocess' with --supernodes: real SuperNodes run Flower's "
                "deployment runtime, one process per node. Drop --supernodes to run "
                "in-process, or set runtime = 'auto' to run on SuperNodes.")
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
    if r.runtime == "ray":
        return Runtime("ray", "runtime = 'ray'")
    if r.runtime == "inprocess":
        return Runtime("inprocess", "runtime = 'inprocess'")
    if r.ray_address:
        return Runtime("ray", f"ray-address = {r.ray_address}")
    if shares:
        return Runtime("ray", f"client-gpus = {r.client_gpus} on a CUDA machine")
    return Runtime("inprocess", "runtime = 'auto'")
