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
from privacy.attacks.inversion import Reconstruction
from privacy.attacks.observation import Observation, state_dict
from privacy.attacks.registry import (
    ATTACKS,
    AttackContext,
    AttackSettings,
    AttackSkipped,
    CanaryScores,
    LabelGuess,
    MembershipScores,
)
from privacy.dp.dpfedavg import CentralAccountant
from server.task import ServerTask
from strategies.central_dp import central_params
from strategies.protocols.secagg import quantization_slack
from tasks.config import (
    ConfigError,
    RunConfig,
)
from tasks.files import read_text
from tasks.results.folder import read_run_info
from tasks.results.ledger import read_ledger
from tasks.seeding import derive_seed
from tasks.splits import model_for
from tasks.training import resolve_device

from .inputs import check, load, select
from .plots import reconstruction_grid, roc_plot
from .report import headline, record, summarize
from .spread import run_spread_plots
from .truth import truth_for

LEDGER = "leakage.jsonl"
RECONSTRUCTIONS = "reconstructions"  # the attacks' reconstructions, in pixels (npz)
Echo = Callable[[str], None]


# --------------------------------------------------------------------------- attacks


class Attacker:
    """Runs the requested attacks (by name, from :data:`privacy.attacks.registry.ATTACKS`)
    on one observation and scores their output against the truth, as the attack's
    ``scored_as`` says (:data:`SCORERS`)."""

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
        self.audit_family = 1  # how many observations of the run are audited
        # membership candidates: members then held-out rows, shown to the attacks shuffled
        (mx, my), (hx, hy) = self.truth.members, self.truth.nonmembers
        self.members = len(my)
        self.order = torch.randperm(len(my) + len(hy),
                                    generator=torch.Generator().manual_seed(self.seed))
        lk = cfg.leakage
        self.context = AttackContext(
            model=self.model, sent=self.sent, received=self.received, update=self.update,
            seed=self.seed,
            settings=AttackSettings(lk.invert_iterations, lk.invert_restarts, lk.invert_lr,
                                    lk.invert_tv, lk.invert_labels, lk.invert_max_examples,
                                    cfg.privacy.dp, invert_keep=lk.invert_keep,
                                    invert_refine=lk.invert_refine,
                                    invert_refine_tv=lk.invert_refine_tv,
                                    dlg_iterations=lk.dlg_iterations),
            candidates=(torch.cat([mx, hx])[self.order], torch.cat([my, hy])[self.order]),
            canaries=None if self.truth.canaries is None else self.truth.canaries[0],
            given_labels=self.truth.y if lk.invert_labels == "given" else None,
            progress=lambda text: self.echo(f"    {obs.name}: {text}"))

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

    def run(self, name: str) -> dict[str, Any]:
        """Attack the observation with the registered attack ``name``; its scores."""
        kind = ATTACKS.info(name).scored_as
        if kind == "membership" and self.members < 2:
            return {"skipped": f"{self.members} member/non-member pairs: too few to score "
                               "(see observed-examples and leakage-holdout)"}
        try:
            output = ATTACKS.load(name)(self.obs, self.context)
        except AttackSkipped as exc:
            return {"skipped": str(exc)}
        want = OUTPUTS[kind]
        if not isinstance(output, want):
            raise TypeError(f"attack {name!r} is scored as {kind} and must return a "
                            f"{want.__name__}, not {type(output).__name__} (see "
                            "privacy.attacks.registry).")
        return SCORERS[kind](self, name, output)

    def score_labels(self, name: str, guess: LabelGuess) -> dict[str, Any]:
        return {"label-accuracy": label_accuracy(guess.labels.cpu(), self.truth.y),
                "method": guess.method}

    def score_reconstruction(self, name: str, rec: Reconstruction) -> dict[str, Any]:
        o = self.obs
        scores = reconstruction_scores(rec.x, rec.y, self.truth.x, self.truth.y, o.mean, o.std)
        out = {"seconds": rec.seconds, "labels": rec.labels, "objective": rec.loss,
               **{k: v for k, v in scores.items() if k != "matched"}}
        if o.kind == "image":
            out["psnr-random"] = random_image_psnr(self.truth.x, o.mean, o.std, self.seed)
            grid = reconstruction_grid(
                self.run_dir / "plots" / "leakage" / f"{o.name}-{name}.png", self.truth.x,
                rec.x, scores["matched"], o.mean, o.std,
                f"{o.name}: {name}, PSNR {scores['psnr']:.1f} dB, SSIM {scores['ssim']:.2f}"
                f" (labels {rec.labels})")
            out["grid"] = str(grid.relative_to(self.run_dir))
            pixels = self.run_dir / RECONSTRUCTIONS / f"{o.name}-{name}.npz"
            pixels.parent.mkdir(exist_ok=True)
            np.savez_compressed(  # for side-by-side comparisons across runs (sweeps)
                pixels, reconstruction=to_pixels(rec.x, o.mean, o.std).numpy(),
                original=to_pixels(self.truth.x[scores["matched"]], o.mean, o.std).numpy())
            out["pixels"] = str(pixels.relative_to(self.run_dir))
        return out

    def score_membership(self, name: str, result: MembershipScores) -> dict[str, Any]:
        k = self.members
        curves = {}
        for variant, shuffled in result.scores.items():
            s = torch.empty_like(shuffled.cpu())
            s[self.order] = shuffled.cpu()  # back to members first, then held-out rows
            curves[variant] = membership_scores(s[:k].numpy(), s[k:].numpy())
        head = result.headline
        plot = roc_plot(self.run_dir / "plots" / "leakage" / f"{self.obs.name}-{name}.png",
                        curves, f"{self.obs.name}: membership inference ({k} members, {k} "
                                "held out)")
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

    def score_audit(self, name: str, canary: CanaryScores) -> dict[str, Any]:
        lk = self.cfg.leakage
        assert self.truth.canaries is not None
        included = self.truth.canaries[1]  # which canaries were included: only scored
        claimed = self._claimed()
        delta = claimed["delta"] if claimed["delta"] is not None else 1e-5
        # Bonferroni over the run's audited observations: the summary reports the largest
        # bound, which then holds at the stated confidence jointly, not each on its own
        confidence = 1 - (1 - lk.audit_confidence) / self.audit_family
        result = audit(canary.scores, included, delta, confidence, lk.audit_guess_fraction)
        return {"epsilon-lower-bound": result.epsilon_lower_bound, "canaries": result.canaries,
                "guesses": result.guesses, "correct": result.correct,
                "confidence": lk.audit_confidence, "per-observation-confidence": confidence,
                "observations-audited": self.audit_family, "audited": canary.audited,
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


# How each kind of attack output is scored (AttackInfo.scored_as), and what it must be.
SCORERS: dict[str, Callable[[Attacker, str, Any], dict[str, Any]]] = {
    "labels": Attacker.score_labels,
    "reconstruction": Attacker.score_reconstruction,
    "membership": Attacker.score_membership,
    "audit": Attacker.score_audit,
}
OUTPUTS: dict[str, type] = {"labels": LabelGuess, "reconstruction": Reconstruction,
                            "membership": MembershipScores, "audit": CanaryScores}


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
            result = {"skipped": broken} if broken else attacker.run(name)
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
    run_spread_plots(run_dir, lines)  # with several inverted updates: their spread
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
