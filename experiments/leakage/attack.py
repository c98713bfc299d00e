"""`fedpriv attack`: run the leakage attacks on a run's observations and score them.

The ServerApp saved what it observed (``observations/``, :mod:`server.observe`); here
the attacks (:mod:`privacy.attacks`) get exactly that, and the scoring side — which
alone reads the clients' real data, their canaries and who was a member — measures
what they recovered. `fedpriv run` runs this after every run with ``leakage-rounds``
(in a child process); ``fedpriv attack RUN_DIR`` runs it again on any run folder, with
other attacks or attack settings, and with the same seed gives the same numbers.

Writes ``leakage.jsonl`` (one line per observation and attack; a re-run replaces the
lines of what it re-ran), ``leakage.json`` (the summary), ``plots/leakage/``
(reconstruction grids, ROC curves), ``reconstructions/`` (the reconstructions in pixels)
and a "What leaked" section in ``summary.md`` and ``run.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from privacy.analysis.leakage_metrics import (
    label_accuracy,
    membership_scores,
    random_image_psnr,
    reconstruction_scores,
    to_pixels,
)
from privacy.attacks.audit import audit
from privacy.attacks.inversion import InversionConfig, Reconstruction, dlg, invert
from privacy.attacks.labels import idlg_label, label_counts, labels_from_counts
from privacy.attacks.membership import alignment_scores, loss_drop_scores, loss_scores
from privacy.attacks.observation import Observation, state_dict
from privacy.attacks.simulate import batches, flatten
from privacy.dp.dpfedavg import CentralAccountant
from server.federation import ServerTask
from server.ledger import read_ledger
from server.results import read_run_info
from strategies.central_dp import central_params
from strategies.protocols.secagg import quantization_slack
from tasks.config import (
    ConfigError,
    RunConfig,
)
from tasks.files import read_text
from tasks.seeding import derive_seed
from tasks.splits import model_for
from tasks.training import resolve_device

from .inputs import check, load, select
from .plots import reconstruction_grid, roc_plot
from .report import headline, record, summarize
from .truth import truth_for

LEDGER = "leakage.jsonl"
# The membership attack each observation reports (all are recorded): the loss drop
# between the weights sent and those observed, calibrated per record by the sent model.
MIA_HEADLINE = {"client": "update-loss-drop", "aggregate": "global-loss-drop"}
RECONSTRUCTIONS = "reconstructions"  # the attacks' reconstructions, in pixels (npz)
Echo = Callable[[str], None]


# --------------------------------------------------------------------------- attacks


class Attacker:
    """Runs the requested attacks on one observation and scores them against the truth."""

    def __init__(self, cfg: RunConfig, obs: Observation, task: ServerTask, run_dir: Path,
                 echo: Echo) -> None:
        self.cfg, self.obs, self.run_dir, self.echo = cfg, obs, run_dir, echo
        device = resolve_device(cfg.resources.device)  # the GPU when there is one
        self.model = model_for(cfg)[0].to(device)
        self.sent = {k: v.to(device) for k, v in state_dict(obs.sent).items()}
        self.received = {k: v.to(device) for k, v in state_dict(obs.received).items()}
        self.update = {k: v.to(device) for k, v in obs.update().items()}
        self.truth = truth_for(cfg, obs, task, run_dir)
        self.seed = derive_seed(cfg.training.seed, obs.round, 0xA66 if obs.client is None
                                else obs.client, 0xA7)
        self._labels: torch.Tensor | None = None
        self.audit_family = 1  # how many observations of the run are audited

    @property
    def num_clients(self) -> int:
        info = read_run_info(self.run_dir)
        return int(info.get("num-clients", self.cfg.federation.num_clients))

    def _slack(self) -> float:
        """How far SecAgg+'s quantization can lengthen an update (0 without it)."""
        if not self.cfg.secagg.enabled:
            return 0.0
        return quantization_slack(self.cfg.secagg,
                                  sum(p.numel() for p in self.model.parameters()))

    def non_finite(self) -> str | None:
        """Why nothing can be attacked when the observed weights hold NaN or infinity (the
        training diverged, e.g. under heavy central-DP noise), else None."""
        for what, weights in (("sent", self.sent), ("returned", self.received)):
            if not all(bool(torch.isfinite(v).all()) for v in weights.values()
                       if v.is_floating_point()):
                return (f"the {what} weights are not finite (NaN or infinity): the training "
                        "diverged before this round, so there is nothing to attack")
        return None

    @property
    def n(self) -> int | None:
        return self.obs.num_examples

    def recovered_labels(self) -> torch.Tensor:
        """The labels as the attacker reads them from the update (iDLG, or counts)."""
        if self._labels is None:
            o = self.obs
            if self.n == 1 and len(batches(1, o.training)) == 1:
                self._labels = torch.tensor([idlg_label(self.update, self.model)])
            else:
                self._labels = labels_from_counts(label_counts(
                    self.update, self.model, self.sent, self.n, o.training, o.input_shape,
                    seed=self.seed))
        return self._labels

    def labels(self) -> dict[str, Any]:
        return {"label-accuracy": label_accuracy(self.recovered_labels(), self.truth.y),
                "method": "idlg" if self.n == 1 else "counts"}

    def _reconstruction(self, method: str) -> dict[str, Any]:
        lk, o = self.cfg.leakage, self.obs
        if self.n is None:
            return {"skipped": "the client did not disclose its number of examples"}
        if self.n > lk.invert_max_examples:
            return {"skipped": f"{self.n} examples, more than invert-max-examples = "
                               f"{lk.invert_max_examples}"}
        given = lk.invert_labels == "given"
        labels = torch.sort(self.truth.y).values if given else self.recovered_labels()

        def progress(text: str) -> None:
            self.echo(f"    {o.name}: {text}")

        if method == "invert":
            rec = invert(self.model, self.sent, self.update, labels, o.training, o.input_shape,
                         InversionConfig(lk.invert_iterations, lk.invert_restarts, lk.invert_lr,
                                         lk.invert_tv, self.seed),
                         mean=o.mean, std=o.std, labels_source="given" if given else "recovered",
                         progress=progress)
        else:
            rec = dlg(self.model, self.sent, self.update, self.n, o.num_classes, o.training,
                      o.input_shape, iterations=min(lk.invert_iterations, 300),
                      labels=labels if given else None, seed=self.seed,
                      restarts=lk.invert_restarts, progress=progress)
        return self._score_reconstruction(rec, method)

    def _score_reconstruction(self, rec: Reconstruction, method: str) -> dict[str, Any]:
        o = self.obs
        scores = reconstruction_scores(rec.x, rec.y, self.truth.x, self.truth.y, o.mean, o.std)
        out = {"seconds": rec.seconds, "labels": rec.labels, "objective": rec.loss,
               **{k: v for k, v in scores.items() if k != "matched"}}
        if o.kind == "image":
            out["psnr-random"] = random_image_psnr(self.truth.x, o.mean, o.std, self.seed)
            grid = reconstruction_grid(
                self.run_dir / "plots" / "leakage" / f"{o.name}-{method}.png", self.truth.x,
                rec.x, scores["matched"], o.mean, o.std,
                f"{o.name}: {method}, PSNR {scores['psnr']:.1f} dB, SSIM {scores['ssim']:.2f}"
                f" (labels {rec.labels})")
            out["grid"] = str(grid.relative_to(self.run_dir))
            pixels = self.run_dir / RECONSTRUCTIONS / f"{o.name}-{method}.npz"
            pixels.parent.mkdir(exist_ok=True)
            np.savez_compressed(  # for side-by-side comparisons across runs (sweeps)
                pixels, reconstruction=to_pixels(rec.x, o.mean, o.std).numpy(),
                original=to_pixels(self.truth.x[scores["matched"]], o.mean, o.std).numpy())
            out["pixels"] = str(pixels.relative_to(self.run_dir))
        return out

    def invert(self) -> dict[str, Any]:
        return self._reconstruction("invert")

    def dlg(self) -> dict[str, Any]:
        return self._reconstruction("dlg")

    def mia(self) -> dict[str, Any]:
        (mx, my), (hx, hy) = self.truth.members, self.truth.nonmembers
        x, y, k = torch.cat([mx, hx]), torch.cat([my, hy]), len(my)
        if k < 2:
            return {"skipped": f"{k} member/non-member pairs: too few to score (see "
                               "observed-examples and leakage-holdout)"}
        released = state_dict(self.obs.released) if self.obs.released else self.received
        attacks = {"global-loss": loss_scores(self.model, released, x, y),
                   "global-loss-drop": loss_drop_scores(self.model, self.sent, released, x, y)}
        if self.obs.client is not None:
            attacks["update-loss"] = loss_scores(self.model, self.received, x, y)
            attacks["update-loss-drop"] = loss_drop_scores(self.model, self.sent, self.received,
                                                           x, y)
            attacks["update-alignment"] = alignment_scores(self.model, self.sent, self.update,
                                                           x, y)
        curves = {name: membership_scores(s[:k].numpy(), s[k:].numpy())
                  for name, s in attacks.items()}
        # The headline is fixed in advance, not the best of five after the fact (on a few
        # members, the maximum AUC of several attacks is biased upwards).
        head = MIA_HEADLINE["client" if self.obs.client is not None else "aggregate"]
        plot = roc_plot(self.run_dir / "plots" / "leakage" / f"{self.obs.name}-mia.png", curves,
                        f"{self.obs.name}: membership inference ({k} members, {k} held out)")
        roc = curves[head]["roc"]
        keep = np.unique(np.linspace(0, len(roc["fpr"]) - 1, min(200, len(roc["fpr"])))
                         .astype(int))
        return {"attack-used": head, "members": k,
                **{key: curves[head][key] for key in ("auc", "auc-ci95", "tpr-at-1%fpr",
                                                      "tpr-at-0.1%fpr")},
                "roc-curve": {"fpr": [roc["fpr"][i] for i in keep],
                              "tpr": [roc["tpr"][i] for i in keep]},
                "attacks": {n: {k2: v for k2, v in c.items() if k2 != "roc"}
                            for n, c in curves.items()},
                "roc": str(plot.relative_to(self.run_dir))}

    def audit(self) -> dict[str, Any]:
        lk, o = self.cfg.leakage, self.obs
        assert self.truth.canaries is not None
        canaries, included = self.truth.canaries  # the attacker knows the canaries, not
        # which were included: that is only scored
        central = self.cfg.privacy.dp == "central"
        target = ({k: torch.from_numpy(np.asarray(o.released[k], np.float32) - o.sent[k])
                   for k in o.sent} if central and o.released else self.update)
        keys = [k for k, _ in self.model.named_parameters()]
        scores = canaries.scores(flatten(target, keys))
        claimed = self._claimed()
        delta = claimed["delta"] if claimed["delta"] is not None else 1e-5
        # Bonferroni over the run's audited observations: the summary reports the largest
        # bound, which then holds at the stated confidence jointly, not each on its own
        confidence = 1 - (1 - lk.audit_confidence) / self.audit_family
        result = audit(scores, included, delta, confidence, lk.audit_guess_fraction)
        return {"epsilon-lower-bound": result.epsilon_lower_bound, "canaries": result.canaries,
                "guesses": result.guesses, "correct": result.correct,
                "confidence": lk.audit_confidence, "per-observation-confidence": confidence,
                "observations-audited": self.audit_family,
                "audited": "released model" if central else "client update",
                **claimed, "delta": delta}

    def _claimed(self) -> dict[str, Any]:
        """The accountant's (epsilon, delta) for what was audited: everything the run did up
        to and including the observed round (the weights sent already carry the canaries'
        earlier rounds), i.e. the run's cumulative epsilon at that round."""
        if self.cfg.privacy.dp == "local":
            d = self.obs.disclosed
            return {"epsilon-claimed": _float(d.get("epsilon")), "delta": _float(d.get("delta")),
                    "claimed-by": "the client's DP-SGD accountant (record-level)"}
        if self.cfg.privacy.dp == "central":
            # a canary changes one record of a client that stays: record-level accounting
            releases = sum(1 for r in read_ledger(self.run_dir)
                           if r.round <= self.obs.round and r.privacy)
            params = central_params(self.cfg, self.num_clients, self._slack())
            return {"epsilon-claimed": CentralAccountant(params).record_epsilon_after(releases),
                    "delta": params.target_delta,
                    "claimed-by": "DP-FedAvg's noise, accounted record-level (sensitivity 2C "
                                  "per round, no amplification)"}
        return {"epsilon-claimed": None, "delta": None, "claimed-by": "no DP"}


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


# --------------------------------------------------------------------------- the stage


def run_attacks(run_dir: Path, attacks: Sequence[str] | None = None, sets: Sequence[str] = (),
                rounds: Sequence[int] | None = None, clients: Sequence[int] | None = None,
                echo: Echo = print) -> dict[str, Any]:
    """Attack every selected observation; write and return the results."""
    cfg, observations = load(run_dir, sets)
    attacks = list(attacks or cfg.leakage.attack_list())
    chosen = select(observations, rounds, clients)
    check(cfg, chosen, attacks)
    lines = _merge(run_dir / LEDGER, [])  # a damaged ledger is refused before any work
    torch.manual_seed(cfg.training.seed)
    task = ServerTask.load(cfg)
    echo(f"attacking {len(chosen)} observation(s) with {', '.join(attacks)}")
    for obs in chosen:
        attacker = Attacker(cfg, obs, task, run_dir, echo)
        attacker.audit_family = max(1, sum(o.client is not None for o in observations))
        broken = attacker.non_finite()
        new = []
        for name in attacks:
            result = {"skipped": broken} if broken else getattr(attacker, name)()
            line = {"round": obs.round,
                    "client": "aggregate" if obs.client is None else obs.client,
                    "attack": name, **result}
            new.append(line)
            echo(f"  {obs.name} {name}: {headline(line)}")
        lines = _merge(run_dir / LEDGER, new)  # written per observation: a crash keeps these
        (run_dir / LEDGER).write_text("".join(json.dumps(x, default=float) + "\n"
                                              for x in lines))
    summary = summarize(lines)
    (run_dir / "leakage.json").write_text(json.dumps(summary, indent=2, default=float))
    record(run_dir, summary)
    return summary


def _merge(path: Path, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier results, with those for the same observation and attack replaced."""
    redone = {(x["round"], x["client"], x["attack"]) for x in new}
    try:
        old = [json.loads(x) for x in read_text(path).splitlines() if x.strip()] \
            if path.exists() else []
        kept = [x for x in old if (x["round"], x["client"], x["attack"]) not in redone]
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{path} has a damaged line ({type(exc).__name__}: {exc}); move it "
                          "away (its results are then redone) or restore it.") from None
    return sorted(kept + new, key=lambda x: (x["round"], str(x["client"])))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.leakage.attack RUN_DIR`` (what `fedpriv run` starts after a run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        run_attacks(args.run_dir, echo=lambda line: print(line, flush=True))
    except ConfigError as exc:
        print(f"fedpriv: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
