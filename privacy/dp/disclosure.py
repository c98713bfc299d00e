"""What a client may send the server in the clear, beside its (possibly private) update.

Every value in a client's reply is one of:

- **identity**: which partition the node holds (``partition-id``, ``num-partitions``),
  whether it serves its own data (``own-data``), keeps state for a resume
  (``keeps-state``) and found it (``has-state``), and whether its operator agreed to a
  malicious-server study (``accepts-trap-weights``): node configuration, not data; the
  server knows whom it talks to.
- **a function of the config and the public size**: ``num-examples`` and what local
  DP-SGD's public schedule fixes (``epsilon``, ``delta``, ``noise-multiplier``,
  ``sample-rate``, ``dp-steps``, ``dp-skipped``, ``train-steps``). Under add/remove
  neighbours they come from the public size N (:mod:`privacy.dp.public`), so they reveal
  nothing about the client's records; under replace-one from n, which that relation
  makes public.
- **a function of the weights the server sent**: ``screen-refused`` (the client's
  ``client-screen`` refused them, :mod:`privacy.screening`): the server could compute it.
- **data-dependent** (everything else: training loss and accuracy, evaluation results,
  label histograms, update norms and clipping bits, timings, release scores): computed
  on private records and covered by no epsilon.

The policy (:func:`policy`): with ``dp = "local"`` a client discloses identity and
n-derived values only; under secure aggregation only identity (plus the n-derived DP
status with local DP), so the server learns nothing per client beyond who took part;
``report-client-metrics = true`` lifts the restriction and the run says so. Without
either, nothing is claimed about what clients send (central DP trusts the server with
raw updates), so everything is sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

IDENTITY = frozenset({"partition-id", "num-partitions", "own-data", "keeps-state",
                      "has-state", "accepts-trap-weights"})
SENT_WEIGHTS = frozenset({"screen-refused"})
RECORD_COUNT = frozenset({"num-examples", "train-steps", "epsilon", "delta",
                          "noise-multiplier", "sample-rate", "dp-steps", "dp-skipped"})


@dataclass(frozen=True)
class Disclosure:
    """Which reply values a client sends in the clear (``allowed`` None: all of them)."""

    allowed: frozenset[str] | None
    reason: str

    @property
    def restricted(self) -> bool:
        return self.allowed is not None

    def permits(self, key: str) -> bool:
        return self.allowed is None or key in self.allowed

    def filter(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in values.items() if self.permits(k)}

    def describe(self) -> dict[str, Any]:
        """For run.json: what the server could read of each client besides the update."""
        return {"client-values-in-clear": "all" if self.allowed is None
                else sorted(self.allowed), "why": self.reason}


def policy(dp: str, secure_aggregation: bool, report_all: bool) -> Disclosure:
    """The disclosure rule for a run (see the module docstring)."""
    if report_all:
        return Disclosure(None, "report-client-metrics = true: clients send all their metrics; "
                                "values computed on their data are covered by no epsilon")
    if secure_aggregation:
        allowed = IDENTITY | SENT_WEIGHTS | (RECORD_COUNT if dp == "local" else frozenset())
        return Disclosure(allowed, "secure aggregation: the server learns only the sum and who "
                          "took part" + (" (and, with local DP, each client's DP status, a "
                                        "function of its record count)" if dp == "local" else ""))
    if dp == "local":
        return Disclosure(IDENTITY | SENT_WEIGHTS | RECORD_COUNT,
                          "local DP: only the DP-SGD update and values its public schedule "
                          "fixes (public size N, or n under replace-one)")
    return Disclosure(None, "no client-side privacy claim, so clients send all their metrics"
                      + ("; central DP protects the released model, and the server sees raw "
                         "updates" if dp == "central" else ""))


def declined(metrics: Mapping[str, Any]) -> str | None:
    """Why a client sent no update although it answered (its DP budget is spent, or its
    screen refused the weights), or None when it trained."""
    if metrics.get("dp-skipped"):
        return "out of privacy budget"
    if metrics.get("screen-refused"):
        return "refused the weights (client-screen)"
    return None
