"""The server's own evaluation of each global model, on the held-out test set."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from tasks.splits import Split
from tasks.training import evaluate


class CentralEvaluator:
    """Loads a global model into ``model`` and scores it on the test split.

    After the loop ``model`` holds the last model evaluated: the final global model.
    """

    def __init__(self, model: torch.nn.Module, test: Split, batch_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.test = test
        self.batch_size = batch_size
        self.device = device

    def __call__(self, arrays: ArrayRecord) -> dict[str, float]:
        self.model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(self.model, self.test.x, self.test.y, self.batch_size, self.device)
        return {"loss": loss, "accuracy": acc}
