"""What the server holds of the task, and the clients it found for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.serverapp import Grid

from tasks.config import RunConfig
from tasks.datasets import DatasetBundle
from tasks.embeddings import backbone_info, backbone_spec
from tasks.models import count_parameters
from tasks.results.folder import RunFolder, settings_title
from tasks.results.info import RunInfo
from tasks.results.plots import plot_label_distribution
from tasks.splits import (
    Split,
    dataset_for,
    feature_shape,
    heldout_split,
    model_for,
    model_inputs,
    validation_split,
)
from tasks.training import resolve_device

from .console import say
from .discovery import (
    ClientInfo,
    DiscoveryError,
    assign_partitions,
    discover_clients,
    simulated,
)
from .evaluation import CentralEvaluator
from .observe import ObservationHook


@dataclass
class ServerTask:
    """What the server holds of the task: the data's description, its test split, the model."""

    data: DatasetBundle
    test: Split
    model: torch.nn.Module
    model_name: str
    validation: Split | None = None  # for model selection (validation-fraction)

    @classmethod
    def load(cls, cfg: RunConfig) -> ServerTask:
        test = heldout_split(cfg)
        test = Split(model_inputs(cfg, test.x), test.y, test.num_classes)
        model, name = model_for(cfg)
        test, validation = validation_split(cfg, test)
        return cls(dataset_for(cfg), test, model, name, validation)

    def observer(self, cfg: RunConfig, run: RunFolder, num_clients: int) -> ObservationHook:
        images = not cfg.embeddings.enabled and self.data.kind == "image"
        return ObservationHook(cfg, run.path, num_clients, feature_shape(cfg),
                               self.data.num_classes, self.data.mean if images else (0.0,),
                               self.data.std if images else (1.0,),
                               "image" if images else "vector")

    def describe(self, cfg: RunConfig, info: RunInfo, show_data: bool = True) -> None:
        """Record (and print) the data, the model and the backbone in run.json
        (``show_data``: False when the CLI's pre-flight line has shown the data)."""
        info.dataset, info.dataset_source = self.data.summary(), self.data.source
        info.model, info.parameters = self.model_name, count_parameters(self.model)
        if cfg.embeddings.enabled:
            b = info.backbone = backbone_info(backbone_spec(cfg.embeddings, cfg.data))
            say(f"features: {b.get('embedding-dim')}-d embeddings from a frozen "
                f"{b.get('backbone')} trained on {b.get('trained-on')}")
        if show_data:
            say(f"data: {self.data.summary()}")

    def title(self, cfg: RunConfig) -> str:
        """The plots' title."""
        return (f"{cfg.data.dataset} · {self.model_name} · {cfg.federation.strategy} · "
                f"{cfg.federation.num_clients} clients · {settings_title(cfg)}")

    def evaluator(self, cfg: RunConfig) -> CentralEvaluator:
        return CentralEvaluator(self.model, self.test, cfg.training.eval_batch_size,
                                resolve_device(cfg.resources.device), self.validation)


def discover(grid: Grid, cfg: RunConfig, task: ServerTask, run: RunFolder, title: str
             ) -> list[ClientInfo]:
    """The run's clients (assigned in simulation, asked on SuperNodes); write
    partitions.json and, when the clients disclosed them, the label plot."""
    fed = cfg.federation
    if simulated(grid):
        clients = assign_partitions(grid, fed.num_clients, fed.round_timeout)
    else:
        clients = discover_clients(grid, fed.round_timeout)
        refused = [c.partition_id for c in clients if not c.accepts_traps]
        if cfg.leakage.server == "malicious" and refused:
            raise DiscoveryError(
                f"server = 'malicious' sends every client trap weights that read its records "
                f"out of its update, and the operators of client(s) "
                f"{', '.join(map(str, sorted(refused)))} have not agreed to it: no round "
                "was run. Each host that takes part starts its SuperNode with `fedpriv "
                "deploy supernode ... --accept-trap-weights`; or run the study in "
                "simulation (`fedpriv run`), where every client is yours.")
        if len(clients) != fed.num_clients:
            say(f"note: the federation has {len(clients)} clients (num-partitions of its "
                f"nodes) but num-clients = {fed.num_clients}; using {len(clients)}.")
    partitions = [c.as_json() for c in clients]
    run.write_json("partitions.json", {"partitioner": cfg.data.partitioner,
                                       "num-classes": task.data.num_classes,
                                       "clients": partitions})
    if all(c.label_counts is not None for c in clients):
        plot_label_distribution(run.path / "plots" / "label_distribution.png", partitions,
                                f"label distribution — {title}")
    return clients
