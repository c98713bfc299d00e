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
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clients.update import observed_rows
from privacy.analysis.leakage_metrics import (
    label_accuracy,
    random_image_psnr,
    reconstruction_scores,
    to_pixels,
)
from privacy.attacks.audit_view import CanaryView
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
from server.checkpoint import probe_write
from server.task import ServerTask
from strategies.central_dp import central_params
from strategies.protocols.secagg import quantization_slack
from tasks.config import (
    ConfigError,
    RunConfig,
)
from tasks.files import read_text
from tasks.progress import Bar
from tasks.results.folder import read_run_info
from tasks.results.ledger import read_ledger
from tasks.seeding import derive_seed
from tasks.splits import dataset_for, model_for, reference_split
from tasks.training import resolve_device

from .audit_run import AuditedRound, audit_line, family_size, whole_run_lines
from .inputs import check, load, select
from .membership import UNSET, score_membership
from .plots import reconstruction_grid
from .report import claim_verdict, headline, record, summarize
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
        self.audit_family = 1  # how many audits the run makes (.audit_run.family_size)
        self.audited: AuditedRound | None = None  # this observation's canary scores
        self.claim: Any = UNSET  # the DP claim its membership attacks are checked against
        # membership candidates: members then held-out rows, shown to the attacks shuffled
        (mx, my), (hx, hy) = self.truth.members, self.truth.nonmembers
        self.members = len(my)
        self.order = torch.randperm(len(my) + len(hy),
                                    generator=torch.Generator().manual_seed(self.seed))
        lk = cfg.leakage
        reference = reference_split(cfg)  # the server's own auxiliary data
        self.context = AttackContext(
            model=self.model, sent=self.sent, received=self.received, update=self.update,
            seed=self.seed,
            settings=AttackSettings(lk.invert_iterations, lk.invert_restarts, lk.invert_lr,
                                    lk.invert_tv, lk.invert_labels, lk.invert_max_examples,
                                    cfg.privacy.dp, lk.mia_references,
                                    float(obs.disclosed.get("noise-multiplier")
                                          or cfg.privacy.noise_multiplier),
                                    cfg.privacy.max_grad_norm, invert_keep=lk.invert_keep,
                                    invert_refine=lk.invert_refine,
                                    invert_refine_tv=lk.invert_refine_tv,
                                    dlg_iterations=lk.dlg_iterations,
                                    feature_iterations=lk.feature_iterations),
            candidates=(torch.cat([mx, hx])[self.order], torch.cat([my, hy])[self.order]),
            canaries=None if self.truth.canaries is None else self.truth.canaries[0],
            given_labels=self.truth.y if lk.invert_labels == "given" else None,
            reference_data=None if reference is None else (reference.x, reference.y),
            cohort=self._cohort() if obs.client is None else None,
            progress=lambda text: self.echo(f"    {obs.name}: {text}"))

    @property
    def num_clients(self) -> int:
        info = read_run_info(self.run_dir)
        return int(info.get("num-clients", self.cfg.federation.num_clients))

    def _cohort(self) -> tuple[int, int] | None:
        """(clients, records each) of the observed aggregate, as the server knows them: the
        clients its ledger says answered, and the mean partition size the public config
        gives (what an observed client trains on)."""
        record = {r.round: r for r in read_ledger(self.run_dir)}.get(self.obs.round)
        if record is None:
            return None
        failed = {f.get("partition-id") for f in record.failures}
        clients = len([p for p in record.sampled if p not in failed])
        rows = len(dataset_for(self.cfg).y_train) // max(self.num_clients, 1)
        return clients, observed_rows(self.cfg, 0, self.num_clients, rows)

    def slack(self) -> float:
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
        began = time.perf_counter()
        try:
            output = ATTACKS.load(name)(self.obs, self.context)
        except AttackSkipped as exc:
            return {"skipped": str(exc)}
        seconds = time.perf_counter() - began
        want = OUTPUTS[kind]
        if not isinstance(output, want):
            raise TypeError(f"attack {name!r} is scored as {kind} and must return a "
                            f"{want.__name__}, not {type(output).__name__} (see "
                            "privacy.attacks.registry).")
        return {"seconds": seconds, **SCORERS[kind](self, name, output)}

    def score_labels(self, name: str, guess: LabelGuess) -> dict[str, Any]:
        return {"label-accuracy": label_accuracy(guess.labels.cpu(), self.truth.y),
                "method": guess.method}

    def score_reconstruction(self, name: str, rec: Reconstruction) -> dict[str, Any]:
        o = self.obs
        scores = reconstruction_scores(rec.x, rec.y, self.truth.x, self.truth.y, o.mean, o.std)
        out = {"seconds": rec.seconds, "labels": rec.labels, "objective": rec.loss,
               **{k: v for k, v in scores.items() if k != "matched"
                  and not (k == "label-accuracy" and rec.labels in ("none", "per-record"))}}
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

    def score_audit(self, name: str, canary: CanaryScores) -> dict[str, Any]:
        """The three audit bounds of this observation (:mod:`.audit_run`); its scores are
        kept for the whole-run audit (``self.audited``)."""
        assert self.truth.canaries is not None
        included = self.truth.canaries[1]  # which canaries were included: only scored
        claimed = self._claimed()
        self.audited = AuditedRound(self.obs.round, canary.scores, claimed, canary.audited)
        return {**audit_line(self.cfg, canary.scores, included, claimed, self.audit_family),
                "audited": canary.audited}

    def _claimed(self) -> dict[str, Any]:
        """The accountant's (epsilon, delta) for what was audited: everything the run did up
        to and including the observed round (the weights sent already carry the canaries'
        earlier rounds), i.e. the run's cumulative epsilon at that round."""
        if self.cfg.privacy.dp == "local":
            d = self.obs.disclosed
            return {"epsilon-claimed": _float(d.get("epsilon")), "delta": _float(d.get("delta")),
                    "claimed-by": "the client's DP-SGD accountant (record-level)",
                    # without subsampling DP-SGD's privacy curve is exactly Gaussian
                    "gaussian-claim": _float(d.get("sample-rate")) == 1.0,
                    "view": self._view(d)}
        if self.cfg.privacy.dp == "central":
            # a canary changes one record of a client that stays: record-level accounting
            releases = sum(1 for r in read_ledger(self.run_dir)
                           if r.round <= self.obs.round and r.privacy)
            params = central_params(self.cfg, self.num_clients, self.slack())
            return {"epsilon-claimed": CentralAccountant(params).record_epsilon_after(releases),
                    "delta": params.target_delta,
                    "claimed-by": "DP-FedAvg's noise, accounted record-level (sensitivity 2C "
                                  "per round, no amplification)",
                    "gaussian-claim": True}  # Gaussian mechanisms composed
        return {"epsilon-claimed": None, "delta": None, "claimed-by": "no DP"}

    def _view(self, disclosed: dict[str, Any]) -> CanaryView | None:
        return _view_of(self.cfg, disclosed)


def _view_of(cfg: RunConfig, disclosed: dict[str, Any]) -> CanaryView | None:
    """What the server's view of one round's fixed canaries is (:mod:`privacy.attacks.
    audit_view`): the sum of that round's Poisson steps, when the update is exactly that
    sum (plain SGD: no momentum or weight decay weighting the steps, no pruning after)."""
    t = cfg.training
    sigma, q = _float(disclosed.get("noise-multiplier")), _float(disclosed.get("sample-rate"))
    steps = int(disclosed.get("train-steps") or 0)
    if t.momentum or t.weight_decay or cfg.leakage.prune_update or not sigma or not q \
            or steps < 1:
        return None
    return CanaryView(sigma, q, steps)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


# How each kind of attack output is scored (AttackInfo.scored_as), and what it must be.
SCORERS: dict[str, Callable[[Attacker, str, Any], dict[str, Any]]] = {
    "labels": Attacker.score_labels,
    "reconstruction": Attacker.score_reconstruction,
    "membership": score_membership,
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
    check_writable(run_dir)
    torch.manual_seed(cfg.training.seed)
    task = ServerTask.load(cfg)
    echo(f"attacking {len(chosen)} observation(s) with {', '.join(attacks)}")
    per_client: dict[Any, int] = {}
    for o in observations:
        if o.client is not None:
            per_client[o.client] = per_client.get(o.client, 0) + 1
    audited: dict[str, dict[Any, list[AuditedRound]]] = {}  # attack -> client -> rounds
    truths: dict[Any, np.ndarray] = {}
    with Bar("attacks", len(chosen) * len(attacks), eager=True) as bar:
        for obs in chosen:
            attacker = Attacker(cfg, obs, task, run_dir, echo)
            attacker.audit_family = family_size(per_client)
            broken = attacker.non_finite()
            if bar.mode != "quiet":  # an attack's own steps show in the bar, not as lines
                attacker.context.progress = lambda text, o=obs: bar.advance(
                    0, description=f"attacks: {o.name}: {text.strip()}")
            new = []
            for name in attacks:
                bar.advance(0, description=f"attacks: {obs.name} {name}")
                result = {"skipped": broken} if broken else attacker.run(name)
                line = {"round": obs.round,
                        "client": "aggregate" if obs.client is None else obs.client,
                        "attack": name, **result}
                new.append(line)
                echo(f"  {obs.name} {name}: {headline(line)}")
                if attacker.audited is not None and "skipped" not in result:
                    audited.setdefault(name, {}).setdefault(obs.client, []).append(
                        attacker.audited)
                    truths[obs.client] = attacker.truth.canaries[1]
                    attacker.audited = None
                bar.advance()
            # written per observation: a crash keeps these
            lines = _merge(run_dir / LEDGER, new)
            (run_dir / LEDGER).write_text("".join(json.dumps(x, default=float) + "\n"
                                                  for x in lines))
    for name, rounds in audited.items():  # the whole run's audit, per client
        new = whole_run_lines(cfg, name, rounds, truths, family_size(per_client))
        for line in new:
            echo(f"  client-{line['client']} rounds {line['rounds']} {name} (whole run): "
                 f"{headline(line)}")
        lines = _merge(run_dir / LEDGER, new)
        (run_dir / LEDGER).write_text("".join(json.dumps(x, default=float) + "\n"
                                              for x in lines))
    summary = summarize(lines)
    if "claim-violations" in summary:
        echo(claim_verdict(summary["claim-violations"]).replace("**", ""))
    (run_dir / "leakage.json").write_text(json.dumps(summary, indent=2, default=float))
    record(run_dir, summary)
    run_spread_plots(run_dir, lines)  # with several inverted updates: their spread
    return summary


def check_writable(run_dir: Path) -> None:
    """ConfigError before any attack runs when the run folder, or a folder of it the attacks
    write into, cannot take a file (read-only, full, another user's)."""
    for folder in (run_dir, run_dir / "plots", run_dir / "plots" / "leakage",
                   run_dir / RECONSTRUCTIONS):
        if not folder.is_dir():  # made by the attacks: its parent was probed
            continue
        try:
            probe_write(folder)
        except OSError as exc:
            raise ConfigError(
                f"the run folder {run_dir} is not writable ({folder}: "
                f"{exc.strerror or exc}); fedpriv attack writes its results into it "
                f"({LEDGER}, leakage.json, summary.md, run.json, plots/leakage/, "
                f"{RECONSTRUCTIONS}/). Make it writable (or free some space), or copy the "
                "run folder somewhere you can write and attack the copy: cp -r "
                f"{run_dir} COPY && fedpriv attack COPY ...") from None


def _merge(path: Path, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier results, with those for the same observation and attack replaced."""
    def key(x: dict[str, Any]) -> tuple:
        return x["round"], x["client"], x["attack"], x.get("scope", "observation")

    redone = {key(x) for x in new}
    try:
        old = [json.loads(x) for x in read_text(path).splitlines() if x.strip()] \
            if path.exists() else []
        kept = [x for x in old if key(x) not in redone]
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
