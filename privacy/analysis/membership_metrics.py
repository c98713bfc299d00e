"""Scoring a membership attack: ROC AUC and TPR at low FPR, each with a bootstrap interval.

Low false-positive rates are what matter (Carlini et al. 2022): TPR at 1% and 0.1% FPR
is reported only with at least 1/FPR non-members (fewer would read the TPR at zero false
positives off a coarse curve). Intervals are percentile bootstraps (Efron & Tibshirani
1993) that resample members and non-members separately (``scipy.stats.bootstrap``), so
they reflect how few members a client holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.stats import bootstrap, rankdata
from sklearn.metrics import roc_curve

FPRS = {"1%": 0.01, "0.1%": 0.001}
RESAMPLES = 1000


def auc(members: np.ndarray, nonmembers: np.ndarray, axis: int = -1) -> np.ndarray:
    """ROC AUC as the Mann-Whitney statistic (ties count one half), along ``axis``."""
    m, n = members.shape[axis], nonmembers.shape[axis]
    ranks = rankdata(np.concatenate([members, nonmembers], axis=axis), axis=axis)
    r = np.take(ranks, np.arange(m), axis=axis).sum(axis=axis)
    return (r - m * (m + 1) / 2) / (m * n)


def tpr_at(members: np.ndarray, nonmembers: np.ndarray, rate: float, axis: int = -1
           ) -> np.ndarray:
    """The best TPR among thresholds whose FPR is at most ``rate``: the share of members
    scoring above the (k+1)-th highest non-member, k = floor(rate * non-members)."""
    members, nonmembers = np.moveaxis(members, axis, -1), np.moveaxis(nonmembers, axis, -1)
    k = int(np.floor(rate * nonmembers.shape[-1] + 1e-9))
    threshold = -np.sort(-nonmembers, axis=-1)[..., k]
    return (members > threshold[..., None]).mean(axis=-1)


def _interval(statistic: Any, members: np.ndarray, nonmembers: np.ndarray, seed: int
              ) -> tuple[float, float]:
    res = bootstrap((members, nonmembers), statistic, n_resamples=RESAMPLES,
                    confidence_level=0.95, method="percentile", vectorized=True,
                    random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def membership_scores(scores_members: np.ndarray, scores_nonmembers: np.ndarray,
                      seed: int = 0) -> dict[str, Any]:
    """AUC, TPR at 1% and 0.1% FPR (None with too few non-members), their 95% bootstrap
    intervals, and the ROC curve of a membership attack."""
    m = np.asarray(scores_members, dtype=float)
    n = np.asarray(scores_nonmembers, dtype=float)
    truth = np.concatenate([np.ones(len(m)), np.zeros(len(n))])
    fpr, tpr, _ = roc_curve(truth, np.concatenate([m, n]))
    out: dict[str, Any] = {
        "auc": float(auc(m, n)),
        "auc-ci95": _interval(lambda a, b, axis: auc(a, b, axis), m, n, seed)}
    for label, rate in FPRS.items():
        enough = len(n) * rate >= 1
        out[f"tpr-at-{label}fpr"] = float(tpr_at(m, n, rate)) if enough else None
        out[f"tpr-at-{label}fpr-ci95"] = _interval(
            lambda a, b, axis, r=rate: tpr_at(a, b, r, axis), m, n, seed) if enough else None
    out.update({"members": int(len(m)), "nonmembers": int(len(n)),
                "roc": {"fpr": fpr.tolist(), "tpr": tpr.tolist()}})
    return out
