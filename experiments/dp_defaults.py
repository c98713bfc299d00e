"""DP-SGD's own training settings, used when a local-DP run names none of its own.

Plain SGD's defaults (batch 32, lr 0.05, clipping norm 1) train badly under DP-SGD: the noise
std on the averaged gradient is sigma C / B, so DP-SGD wants larger batches, a clipping norm
near the gradients' typical norm and a larger step (Abadi et al. 2016, section 5; Ponomareva
et al. 2023, "How to DP-fy ML", section 5.4). On the embedded MNIST, 10 clients and 10
rounds, ``fedpriv run --set dp=local --set target-epsilon=5`` reaches 45% with the plain
defaults and 85% with these on the small CNN (docs/PRIVACY.md, the dp-epsilon-mnist sweep),
72% and 81% on the MLP (the dp-mlp-mnist sweep).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# the keys a researcher tunes for DP-SGD; a run that sets any one of them keeps all its own
TUNED_KEYS = ("batch-size", "max-grad-norm", "lr")
MNIST_SETTINGS = {"batch-size": 64, "max-grad-norm": 0.5, "lr": 1.0}


@dataclass(frozen=True)
class Tuned:
    """Settings measured for some datasets and models, and what the measurement found."""

    datasets: frozenset[str]
    models: frozenset[str]
    settings: Mapping[str, Any]
    evidence: str  # the plain defaults against these, said in the run's note


TUNED = (
    Tuned(frozenset({"mnist", "fashion-mnist"}), frozenset({"auto", "small-cnn"}),
          MNIST_SETTINGS, "plain SGD's batch 32, lr 0.05 and clipping norm 1 reach about 45% "
          "instead of 85% at epsilon 5"),  # the dp-epsilon-mnist sweep
    Tuned(frozenset({"mnist"}), frozenset({"mlp"}), MNIST_SETTINGS,
          "plain SGD's batch 32, lr 0.05 and clipping norm 1 reach about 72% instead of 81% "
          "at epsilon 5"),  # the dp-mlp-mnist sweep
)
# at a small budget the noise is large (sigma about 4 at epsilon 1): a smaller step
SMALL_BUDGET = 2.0
SMALL_BUDGET_LR = 0.25


def dp_sgd_settings(values: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The settings to add to ``values`` (a run's merged preset and overrides, completed by
    the defaults) and the note that says so; ``({}, None)`` when the run is not local DP or
    sets one of :data:`TUNED_KEYS` itself. A dataset or model without tuned settings gets
    only a hint."""
    if values.get("dp") != "local" or any(k in values for k in TUNED_KEYS):
        return {}, None
    dataset, model = str(values.get("dataset", "mnist")), str(values.get("model", "auto"))
    for tuned in TUNED:
        if dataset in tuned.datasets and model in tuned.models:
            chosen = dict(tuned.settings)
            eps = float(values.get("target-epsilon", 0.0) or 0.0)
            sigma = float(values.get("noise-multiplier", 1.0))
            if (0 < eps < SMALL_BUDGET) or (eps == 0 and sigma >= 2.0):
                chosen["lr"] = SMALL_BUDGET_LR
            said = ", ".join(f"{k} = {v}" for k, v in chosen.items())
            where = dataset if model == "auto" else f"{dataset} with model {model!r}"
            return chosen, (
                f"note: dp = 'local' without batch-size, max-grad-norm or lr of its own: "
                f"using DP-SGD's settings for {where} ({said}; "
                f"{tuned.evidence}). Set any of the three to choose your own.")
    return {}, (
        f"note: dp = 'local' with plain SGD's batch-size, max-grad-norm and lr: DP-SGD "
        f"usually wants a larger batch (64-256), a clipping norm near the gradients' typical "
        f"norm (0.1-1) and a larger step than plain SGD; no tuned settings are known for "
        f"{dataset} with model {model!r} (on MNIST's small CNN: batch-size = 64, "
        "max-grad-norm = 0.5, lr = 1.0).")
