"""Runs inside pfl's own virtualenv (see :mod:`experiments.benchmarks.pfl_compare`).

Reads the workload the parent wrote (every client's tensors, the test set, the initial
weights, the runs to do), trains FedAvg with Apple's pfl (``SimulatedBackend``, CPU, one
process), and prints one JSON line per run: per-round seconds and test accuracy.
"""

from __future__ import annotations

import functools
import json
import sys
import time

import numpy as np
import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel

from tasks.models import build_model
from tasks.training import convolutions_channels_last


class Classifier(torch.nn.Module):
    """fedpriv's model with the loss and metrics methods pfl asks of a module."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, x, y, eval=False):  # noqa: A002  (pfl's keyword)
        self.eval() if eval else self.train()
        return torch.nn.functional.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x, y, eval=True):  # noqa: A002
        self.eval() if eval else self.train()
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        correct = (logits.argmax(1) == y).sum().item()
        return {"loss": Weighted(loss, len(y)), "accuracy": Weighted(correct, len(y))}


class RoundClock(TrainingProcessCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = time.perf_counter()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now
        return False, Metrics()


def run(data: dict, spec: dict, run: dict) -> dict:
    torch.manual_seed(run["seed"])
    np.random.seed(run["seed"])
    n = spec["num_clients"]
    net = build_model(spec["model"], tuple(spec["input_shape"]), spec["num_classes"])
    convolutions_channels_last(net, torch.device("cpu"))  # the kernels fedpriv's clients use
    model = Classifier(net)
    users = {i: (torch.from_numpy(data[f"x{i}"]), torch.from_numpy(data[f"y{i}"]).long())
             for i in range(n)}
    train = FederatedDataset(lambda uid: Dataset(raw_data=list(users[uid]), user_id=uid),
                             get_user_sampler("minimize_reuse", list(range(n))))
    test = Dataset(raw_data=[torch.from_numpy(data["x_test"]),
                             torch.from_numpy(data["y_test"]).long()])
    pfl_model = PyTorchModel(model=model,
                             local_optimizer_create=functools.partial(
                                 torch.optim.SGD, momentum=spec["momentum"],
                                 weight_decay=spec["weight_decay"]),
                             central_optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    clock = RoundClock()
    evaluation = CentralEvaluationCallback(test, NNEvalHyperParams(local_batch_size=512))
    accuracies: list[float] = []

    class Record(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            for name, value in aggregate_metrics:
                if "Central val" in str(name) and "accuracy" in str(name):
                    accuracies.append(float(getattr(value, "overall_value", value)))
            return False, Metrics()

    FederatedAveraging().run(
        # users' own before/after evaluations (pfl's default) off: fedpriv does none
        algorithm_params=NNAlgorithmParams(central_num_iterations=spec["rounds"],
                                           evaluation_frequency=spec["rounds"] + 1,
                                           train_cohort_size=spec["per_round"],
                                           val_cohort_size=0),
        backend=SimulatedBackend(training_data=train, val_data=None),
        model=pfl_model,
        model_train_params=NNTrainHyperParams(local_num_epochs=spec["epochs"],
                                              local_learning_rate=run["lr"],
                                              local_batch_size=spec["batch_size"]),
        model_eval_params=NNEvalHyperParams(local_batch_size=512),
        callbacks=[evaluation, Record(), clock])
    return {"rounds-s": clock.times, "accuracy": accuracies, **run}


def main() -> None:
    spec = json.loads(sys.argv[1])
    data = dict(np.load(spec["data"]))
    for one in spec["runs"]:
        t0 = time.perf_counter()
        out = run(data, spec, one)
        print(json.dumps({**out, "run-s": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":
    main()
