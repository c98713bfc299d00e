"""Privacy metrics of a release: (originals, release, holdout) in, plain numbers out.

Sanity checks from the seed project, kept because people ask for them:

- ``overlap``: share of released rows equal to some original row;
- ``reconstruction-mse``: mean squared error between each original and its own release;
- ``mean-relative-difference``: mean of ||o - r|| / max(||o||, ||r||), in [0, 2] and
  defined at zero.

Honest ones (an attacker who knows the mechanism and any public map, Kerckhoffs):

- ``reid-top1`` / ``reid-top5``: an attacker holding an original record picks the
  nearest released row(s); success if its own release is among them. Ties (identical
  released vectors, as k-Same produces) are broken uniformly at random, so k-Same
  scores exactly 1/k. Chance level is 1 / (released rows). Synthetic releases have no
  "own release"; there the attacker's nearest released row counts as a hit when it
  points back at the record (the record is its nearest original): memorization.
- ``dcr-share``: for each released row, is its distance to the closest training record
  smaller than to the closest holdout record (the idea of SDMetrics'
  DCROverfittingProtection)? Compared with ``dcr-baseline`` = |train| / (|train| +
  |holdout|), the share expected when the release is no closer to the data it came
  from than to unseen data from the same distribution; 1.0 means copies.
- ``mia-auc``: a distance-based membership-inference attack: score each candidate
  (members vs held-out records, equal numbers) by minus its distance to the nearest
  released row; ROC AUC (0.5 = chance). Reported with the TPR at 1% FPR (Carlini et al.
  2022 ask for low-FPR numbers, not accuracy).
- ``k-level``: the smallest number of released rows sharing one identical vector (the
  k of k-anonymity the release actually achieves; 1 for any noise mechanism).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..anonymize.release import Release
from .distances import chunks, min_dist, sq_dists


def overlap(original: np.ndarray, released: np.ndarray) -> float:
    """Share of released rows that are exact copies of an original row (float32 bytes)."""
    seen = {row.tobytes() for row in np.ascontiguousarray(original, dtype=np.float32)}
    rel = np.ascontiguousarray(released, dtype=np.float32)
    return float(np.mean([row.tobytes() in seen for row in rel]))


def reconstruction_mse(original: np.ndarray, release: Release) -> float | None:
    if release.source is None:
        return None
    ok = release.source >= 0
    diff = original[release.source[ok]].astype(np.float64) - release.x[ok]
    return float(np.mean(diff ** 2))


def mean_relative_difference(original: np.ndarray, release: Release) -> float | None:
    if release.source is None:
        return None
    ok = release.source >= 0
    o = original[release.source[ok]].astype(np.float64)
    r = release.x[ok].astype(np.float64)
    num = np.linalg.norm(o - r, axis=1)
    den = np.maximum(np.linalg.norm(o, axis=1), np.linalg.norm(r, axis=1))
    rel = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
    return float(rel.mean())


def linkage(records: np.ndarray, released: np.ndarray, top: tuple[int, ...] = (1, 5)
            ) -> dict[int, np.ndarray]:
    """Per-record re-identification for releases with no source row (synthetic data).

    For each record the attacker takes its nearest released row and asks whether that
    row points back at the record: is the record among the row's ``k`` nearest
    records? Returns the (tie-split) success of every record. Run on members and
    held-out records together, the held-out rate is the chance level: a generator that
    memorized its training data links members far more often than unseen records.
    """
    o = np.asarray(records, dtype=np.float64)
    r = np.asarray(released, dtype=np.float64)
    # scikit-learn takes about a second to import: only releases without sources pay it
    from sklearn.metrics import pairwise_distances_argmin

    nearest = pairwise_distances_argmin(o, r)
    success = {k: np.zeros(len(o)) for k in top}
    for sl in chunks(len(o)):
        rows = np.arange(len(o))[sl]
        d = sq_dists(r[nearest[rows]], o)  # each picked release vs every record
        d_self = d[np.arange(len(rows)), rows][:, None]
        less = (d < d_self).sum(1)
        equal = (d == d_self).sum(1)
        for k in top:
            success[k][sl] = np.clip((k - less) / equal, 0.0, 1.0)
    return success


def reidentification(original: np.ndarray, release: Release, top: tuple[int, ...] = (1, 5)
                     ) -> dict[int, float] | None:
    """Expected top-k success of matching an original to its own release (ties split evenly).

    Releases without source rows (synthetic data) are scored by :func:`linkage`.
    """
    if release.source is None:
        return {k: float(v.mean()) for k, v in linkage(original, release.x, top).items()}
    own = {}
    for j, i in enumerate(release.source):
        if i >= 0:
            own.setdefault(int(i), j)
    if not own:
        return None
    idx = np.array(sorted(own))
    rel = release.x.astype(np.float64)
    success = {k: 0.0 for k in top}
    for sl in chunks(len(idx)):
        rows = idx[sl]
        d = sq_dists(original[rows].astype(np.float64), rel)
        d_own = d[np.arange(len(rows)), [own[i] for i in rows]][:, None]
        tol = 1e-9 * np.maximum(d_own, 1.0)
        less = (d < d_own - tol).sum(1)
        equal = (np.abs(d - d_own) <= tol).sum(1)
        for k in top:
            success[k] += float(np.clip((k - less) / equal, 0.0, 1.0).sum())
    return {k: v / len(idx) for k, v in success.items()}


def _equal_sizes(a: np.ndarray, b: np.ndarray, rng: np.random.Generator
                 ) -> tuple[np.ndarray, np.ndarray]:
    n = min(len(a), len(b))
    return (a[rng.choice(len(a), n, replace=False)], b[rng.choice(len(b), n, replace=False)])


def dcr_share(released: np.ndarray, members: np.ndarray, holdout: np.ndarray
              ) -> dict[str, float]:
    """Share of released rows closer to the training records than to held-out ones.

    Under no memorization (released rows exchangeable with real unseen records) the
    nearest of the |M| + |H| real records is equally likely to be any of them, so the
    expected share is |M| / (|M| + |H|): ``dcr-baseline``. Copies score 1.0.
    """
    d_train, d_hold = min_dist(released, members), min_dist(released, holdout)
    share = np.mean(d_train < d_hold) + 0.5 * np.mean(d_train == d_hold)
    return {"dcr-share": float(share),
            "dcr-baseline": len(members) / (len(members) + len(holdout)),
            "dcr-train-median": float(np.median(d_train)),
            "dcr-holdout-median": float(np.median(d_hold))}


def mia(released: np.ndarray, members: np.ndarray, holdout: np.ndarray,
        rng: np.random.Generator) -> dict[str, float]:
    """Distance-to-release membership inference: ROC AUC and TPR at 1% FPR."""
    from sklearn.metrics import roc_auc_score, roc_curve  # lazy: about a second to import

    m, h = _equal_sizes(members, holdout, rng)
    scores = -np.concatenate([min_dist(m, released), min_dist(h, released)])
    labels = np.concatenate([np.ones(len(m)), np.zeros(len(h))])
    fpr, tpr, _ = roc_curve(labels, scores)
    return {"mia-auc": float(roc_auc_score(labels, scores)),
            "mia-tpr-at-1%fpr": float(np.interp(0.01, fpr, tpr))}


def k_level(released: np.ndarray) -> int:
    """The smallest multiplicity of an identical released vector."""
    _, counts = np.unique(np.asarray(released), axis=0, return_counts=True)
    return int(counts.min())


def evaluate(original: np.ndarray, release: Release, holdout: np.ndarray | None,
             seed: int = 0) -> dict[str, Any]:
    """All metrics of one client's release. ``original`` are the rows it was fitted on."""
    rng = np.random.default_rng(seed)
    if release.transform is not None:  # compare in the released space, as the attacker can
        original = release.transform(original)
        holdout = None if holdout is None else release.transform(holdout)
    original = np.asarray(original, dtype=np.float32)
    out: dict[str, Any] = {
        "released": int(len(release.x)),
        "overlap": overlap(original, release.x),
        "reconstruction-mse": reconstruction_mse(original, release),
        "mean-relative-difference": mean_relative_difference(original, release),
        "k-level": k_level(release.x),
        "reid-chance": 1.0 / len(release.x),
    }
    if release.source is None and holdout is not None and len(holdout):
        hold = np.asarray(holdout, dtype=np.float32)
        both = linkage(np.concatenate([original, hold]), release.x)
        n = len(original)
        out["reid-top1"], out["reid-top5"] = float(both[1][:n].mean()), float(both[5][:n].mean())
        out["reid-chance"] = float(both[1][n:].mean())
    else:
        reid = reidentification(original, release)
        out["reid-top1"] = None if reid is None else reid[1]
        out["reid-top5"] = None if reid is None else reid[5]
    if holdout is not None and len(holdout):
        out.update(dcr_share(release.x, original, holdout))
        out.update(mia(release.x, original, holdout, rng))
    return out
