"""The attacks by name, and the contract an attack meets (light: no torch is imported).

An attack is a function ``attack(obs: Observation, ctx: AttackContext) -> output``: it
sees what an honest-but-curious server holds (the :class:`.observation.Observation`)
and the same facts ready for torch (:class:`AttackContext`), never the client's data.
What it returns depends on how it is scored (``scored_as``), which the scoring side
(``experiments.leakage``) does against ground truth the attack never sees:

============== ============================================ ==============================
scored_as      output                                       score
============== ============================================ ==============================
labels         :class:`LabelGuess`                          share of true labels recovered
reconstruction :class:`privacy.attacks.inversion.Reconstruction`  PSNR, SSIM, label accuracy
membership     :class:`MembershipScores` over ``ctx.candidates``  ROC AUC, TPR at low FPR
audit          :class:`CanaryScores` for ``ctx.canaries``   epsilon lower bound
============== ============================================ ==============================

An attack that cannot run on an observation raises :class:`AttackSkipped` with the
reason. Register your own with ``@ATTACKS.register("name", description=...,
scored_as=...)`` in a module the run config's ``plugins`` key names (docs/EXTENDING.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..registry import Registry

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn

SCORINGS = ("labels", "reconstruction", "membership", "audit")


@dataclass(frozen=True)
class AttackInfo:
    """An attack's metadata, read by the config checks and the report without importing it.

    ``description``: what it does (``fedpriv attack --help``). ``scored_as``: one of
    :data:`SCORINGS` (see the module docstring). ``aggregate``: it also runs on the
    aggregate update alone (what the server holds under secure aggregation). ``title``:
    its line in summary.md (default: the attack's name). ``reference``: it needs the
    server's auxiliary data (``reference-fraction`` > 0).
    """

    description: str
    scored_as: str
    aggregate: bool = False
    title: str = ""
    reference: bool = False  # it trains references on the server's auxiliary data

    def __post_init__(self) -> None:
        if self.scored_as not in SCORINGS:
            raise ValueError(f"scored_as = {self.scored_as!r}: an attack is scored as one of "
                             f"{', '.join(SCORINGS)} (see privacy.attacks.registry).")


@dataclass(frozen=True)
class AttackSettings:
    """The run's attack settings (the leakage keys an attack reads), as plain values."""

    invert_iterations: int = 2000
    invert_restarts: int = 8
    invert_lr: float = 0.1
    invert_tv: float = 0.01
    invert_labels: str = "recovered"
    invert_max_examples: int = 64
    dp: str = "none"  # the run's DP mode: public, like the architecture
    mia_references: int = 16
    dp_noise: float = 0.0  # local DP-SGD's noise multiplier and clipping norm (public)
    dp_clip: float = 0.0
    invert_keep: int = 2
    invert_refine: int = 2000
    invert_refine_tv: float = 0.001
    dlg_iterations: int = 300
    feature_iterations: int = 600


@dataclass
class AttackContext:
    """What an attack gets besides the Observation: the same facts, ready for torch, and
    what the study hands every attacker (candidates to judge, the canaries it planted)."""

    model: nn.Module  # the run's architecture (public), on the attack's device
    sent: dict[str, torch.Tensor]  # the weights the server sent, on that device
    received: dict[str, torch.Tensor]  # the weights that came back
    update: dict[str, torch.Tensor]  # received - sent
    seed: int  # derived from the run's seed, the round and the client
    settings: AttackSettings
    # records whose membership a membership attack scores (inputs, labels), half of them
    # the client's, in an order that does not say which
    candidates: tuple[torch.Tensor, torch.Tensor] | None = None
    canaries: Any = None  # the audit's GradientCanaries (not which of them were included)
    given_labels: torch.Tensor | None = None  # the true labels, when invert-labels = given
    # the server's own auxiliary data (reference-fraction: never a client's records)
    reference_data: tuple[torch.Tensor, torch.Tensor] | None = None
    # an aggregate's simulated cohort: (clients, records each), as the server knows them
    cohort: tuple[int, int] | None = None
    progress: Callable[[str], None] = print
    shared: dict[str, Any] = field(default_factory=dict)  # what attacks on it share


@dataclass
class LabelGuess:
    """The labels an attack recovered (a multiset: order does not matter)."""

    labels: torch.Tensor
    method: str = ""


@dataclass
class MembershipScores:
    """Per candidate (``ctx.candidates``, in that order) a score, higher for more likely a
    member; one vector per variant, ``headline`` the one reported (fixed in advance)."""

    scores: dict[str, torch.Tensor]
    headline: str


@dataclass
class CanaryScores:
    """Per canary (``ctx.canaries``), how strongly the audited weights carry it."""

    scores: np.ndarray
    audited: str  # "client update" | "released model"


class AttackSkipped(Exception):
    """The attack cannot run on this observation; the message says why (recorded)."""


ATTACKS: Registry = Registry(
    "attack", where="privacy.attacks.registry.ATTACKS", info=AttackInfo,
    signature="attack(obs: Observation, ctx: AttackContext) -> LabelGuess | Reconstruction | "
              "MembershipScores | CanaryScores (as its scored_as says), registered with "
              "description= and scored_as=")
"""The attacks a run can ask for (run-config key ``attacks``): ``(Observation,
AttackContext) -> output`` with :class:`AttackInfo` as metadata."""
ATTACKS.register("labels", "privacy.attacks.builtin:labels", scored_as="labels",
                 title="labels read off the update",
                 description="which labels the client trained on (iDLG / counts from the last "
                             "layer)")
ATTACKS.register("invert", "privacy.attacks.builtin:invert", scored_as="reconstruction",
                 title="reconstruction (Inverting Gradients)",
                 description="reconstruct its training inputs (Inverting Gradients)")
ATTACKS.register("dlg", "privacy.attacks.builtin:dlg", scored_as="reconstruction",
                 title="reconstruction (DLG)",
                 description="reconstruct them with DLG (L2 matching, L-BFGS), the classic "
                             "baseline")
ATTACKS.register("mia", "privacy.attacks.builtin:mia", scored_as="membership", aggregate=True,
                 title="membership inference (loss drop)",
                 description="membership inference against its update and the released "
                             "global model")
ATTACKS.register("decompose", "privacy.attacks.builtin:decompose", scored_as="membership",
                 aggregate=True, title="membership inference (update decomposition)",
                 description="white-box: the update solved as a combination of the "
                             "candidates' gradients along the local-training path")
TRAPS = ("binning", "binning-disguised")  # what server = 'malicious' sends (imprint.py)
ATTACKS.register("imprint", "privacy.attacks.builtin:imprint", scored_as="reconstruction",
                 aggregate=True, title="records from trap weights (malicious server)",
                 description="with server = 'malicious': read the records out of the trapped "
                             "layer's update or aggregate (Fowl et al. 2022)")
ATTACKS.register("lira", "privacy.attacks.builtin:lira", scored_as="membership",
                 aggregate=True, reference=True,
                 title="membership inference (LiRA, reference updates)",
                 description="LiRA (Carlini et al. 2022), online and offline, calibrated "
                             "against reference updates the server simulates on its own data")
ATTACKS.register("rmia", "privacy.attacks.builtin:rmia", scored_as="membership",
                 aggregate=True, reference=True,
                 title="membership inference (RMIA, reference updates)",
                 description="RMIA (Zarifzadeh et al. 2024) against the same reference updates")
ATTACKS.register("audit", "privacy.attacks.builtin:audit", scored_as="audit",
                 title="audit", description="one-run DP audit with canaries (needs canaries > 0)")


def attacks_scored_as(*kinds: str) -> list[str]:
    """The registered attacks scored as any of ``kinds``."""
    return [name for name, info in ATTACKS.items() if info.scored_as in kinds]


def reference_attacks() -> list[str]:
    """The registered attacks that need the server's auxiliary data."""
    return [name for name, info in ATTACKS.items() if info.reference]


def aggregate_attacks() -> list[str]:
    """The registered attacks that run on the aggregate update alone."""
    return [name for name, info in ATTACKS.items() if info.aggregate]
