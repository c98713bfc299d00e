"""fedpriv's own attacks as registry entries (:data:`.registry.ATTACKS`): each takes what
the server holds of one observation and returns what the scoring side scores."""

from __future__ import annotations

import time

import numpy as np
import torch

from .calibrated import LiRA, class_centered, logit_confidence, true_probability
from .calibrated import rmia as rmia_scores
from .decomposition import decomposition_scores
from .feature_inversion import invert_features
from .imprint import cnn_trunk, recover, trap_labels, trap_layers
from .inversion import InversionConfig, Reconstruction
from .inversion import dlg as dlg_attack
from .inversion import invert as invert_attack
from .labels import idlg_label, label_counts, labels_from_counts
from .membership import alignment_scores, loss_drop_scores, loss_scores
from .observation import Observation, state_dict
from .reference import ReferenceSetup, stacked_logits, train_references
from .registry import AttackContext, AttackSkipped, CanaryScores, LabelGuess, MembershipScores
from .simulate import batches, flatten

# The membership attack each observation reports (all are recorded): the loss drop
# between the weights sent and those observed, calibrated per record by the sent model.
MIA_HEADLINE = {"client": "update-loss-drop", "aggregate": "global-loss-drop"}


def recovered_labels(obs: Observation, ctx: AttackContext) -> torch.Tensor:
    """The labels as the attacker reads them from the update (iDLG, or counts); computed
    once per observation and shared by the attacks that need them."""
    if "labels" not in ctx.shared:
        n = obs.num_examples
        if n is None:
            raise AttackSkipped("the client did not disclose its number of examples")
        if n == 1 and len(batches(1, obs.training)) == 1:
            ctx.shared["labels"] = torch.tensor([idlg_label(ctx.update, ctx.model)])
        else:
            ctx.shared["labels"] = labels_from_counts(label_counts(
                ctx.update, ctx.model, ctx.sent, n, obs.training, obs.input_shape,
                seed=ctx.seed))
    return ctx.shared["labels"]


def labels(obs: Observation, ctx: AttackContext) -> LabelGuess:
    """Which labels the client trained on (iDLG for one example, else counts)."""
    return LabelGuess(recovered_labels(obs, ctx), "idlg" if obs.num_examples == 1 else "counts")


def _inputs(obs: Observation, ctx: AttackContext) -> tuple[int, torch.Tensor, bool]:
    """(examples, labels to use, whether they were given) for a reconstruction."""
    n, s = obs.num_examples, ctx.settings
    if n is None:
        raise AttackSkipped("the client did not disclose its number of examples")
    if n > s.invert_max_examples:
        raise AttackSkipped(f"{n} examples, more than invert-max-examples = "
                            f"{s.invert_max_examples}")
    given = s.invert_labels == "given" and ctx.given_labels is not None
    return n, (torch.sort(ctx.given_labels).values if given  # type: ignore[arg-type]
               else recovered_labels(obs, ctx)), given


def invert(obs: Observation, ctx: AttackContext) -> Reconstruction:
    """Inverting Gradients on the observed update: restarts, then the best one refined."""
    _, y, given = _inputs(obs, ctx)
    s = ctx.settings
    return invert_attack(ctx.model, ctx.sent, ctx.update, y, obs.training, obs.input_shape,
                         InversionConfig(s.invert_iterations, s.invert_restarts, s.invert_lr,
                                         s.invert_tv, ctx.seed, refine=s.invert_refine,
                                         keep=s.invert_keep,
                                         refine_tv=s.invert_refine_tv),
                         mean=obs.mean, std=obs.std,
                         labels_source="given" if given else "recovered",
                         progress=ctx.progress)


def dlg(obs: Observation, ctx: AttackContext) -> Reconstruction:
    """DLG on the observed update: dlg-iterations L-BFGS iterations per restart (no cap)."""
    n, y, given = _inputs(obs, ctx)
    s = ctx.settings
    return dlg_attack(ctx.model, ctx.sent, ctx.update, n, obs.num_classes, obs.training,
                      obs.input_shape, iterations=s.dlg_iterations,
                      labels=y if given else None, seed=ctx.seed, restarts=s.invert_restarts,
                      progress=ctx.progress)


def mia(obs: Observation, ctx: AttackContext) -> MembershipScores:
    """Loss, loss-drop and gradient-alignment membership scores of the candidates."""
    assert ctx.candidates is not None
    x, y = ctx.candidates
    released = state_dict(obs.released) if obs.released else ctx.received
    scores = {"global-loss": loss_scores(ctx.model, released, x, y),
              "global-loss-drop": loss_drop_scores(ctx.model, ctx.sent, released, x, y)}
    if obs.client is not None:
        scores["update-loss"] = loss_scores(ctx.model, ctx.received, x, y)
        scores["update-loss-drop"] = loss_drop_scores(ctx.model, ctx.sent, ctx.received, x, y)
        scores["update-alignment"] = alignment_scores(ctx.model, ctx.sent, ctx.update, x, y)
    # The headline is fixed in advance, not the best of five after the fact (on a few
    # members, the maximum AUC of several attacks is biased upwards).
    return MembershipScores(scores, MIA_HEADLINE["client" if obs.client is not None
                                                 else "aggregate"])


def decompose(obs: Observation, ctx: AttackContext) -> MembershipScores:
    """Which candidates' gradients the update is made of (:mod:`.decomposition`)."""
    assert ctx.candidates is not None
    x, y = ctx.candidates
    update = ctx.update if obs.client is not None else {
        k: v.to(ctx.sent[k].device) - ctx.sent[k]
        for k, v in state_dict(obs.released or obs.received).items()}
    return MembershipScores({"decomposition": decomposition_scores(
        ctx.model, ctx.sent, update, x, y, progress=ctx.progress)}, "decomposition")


def imprint(obs: Observation, ctx: AttackContext) -> Reconstruction:
    """The records that fell alone into a bin of the trap the server sent (only on
    weights a malicious server sent: :mod:`.imprint`)."""
    start = time.perf_counter()
    if obs.tampered != "imprint":
        raise AttackSkipped("the server sent no trap in this round (run with server = "
                            "'malicious')")
    trap = trap_layers(ctx.model)
    # the aggregate the server held (``received``), before central DP's noise if any
    update = ctx.update if obs.client is not None else {
        k: v.to(ctx.sent[k].device) - ctx.sent[k] for k, v in state_dict(obs.received).items()}
    rows = recover(update, trap)
    if trap.raw:
        x = rows.reshape(len(rows), *obs.input_shape)
    else:  # the bins hold the trunk's features: images whose features match them
        ctx.progress(f"    inverting {len(rows)} recovered feature vectors through the trunk")
        x = invert_features(cnn_trunk(ctx.model, ctx.sent).cpu(), rows.cpu(), obs.input_shape,
                            mean=obs.mean, std=obs.std,
                            iterations=ctx.settings.feature_iterations,
                            seed=ctx.seed)
    device = next(iter(ctx.sent.values())).device
    labels = trap_labels(ctx.model, ctx.sent, trap, update, x.to(device), obs.num_classes)
    return Reconstruction(x.cpu(), labels.cpu(), 0.0, time.perf_counter() - start, "imprint",
                          "per-record")


POPULATION = 1000  # RMIA's population records z, kept out of every reference's data


def _references(obs: Observation, ctx: AttackContext) -> dict:
    """Reference updates and every record's logits under them and the target (computed
    once per observation, shared by LiRA and RMIA)."""
    if "references" in ctx.shared:
        return ctx.shared["references"]
    if ctx.reference_data is None:
        raise AttackSkipped("the server holds no auxiliary data (reference-fraction = 0)")
    assert ctx.candidates is not None
    (cx, cy), (ax, ay) = ctx.candidates, ctx.reference_data
    if obs.client is not None:
        if obs.num_examples is None:
            raise AttackSkipped("the client did not disclose its number of examples")
        clients, n = 1, obs.num_examples
    elif ctx.cohort is None:
        raise AttackSkipped("the aggregate's cohort is unknown")
    else:
        clients, n = ctx.cohort
    g = torch.Generator().manual_seed(ctx.seed)
    order = torch.randperm(len(ay), generator=g)
    z = order[:min(POPULATION, len(ay) // 4)]  # population records, in no reference's data
    pool = order[len(z):]
    s = ctx.settings
    setup = ReferenceSetup(obs.training, n, clients, s.mia_references,
                           s.dp_noise if s.dp == "local" else 0.0,
                           s.dp_clip if s.dp == "local" else 0.0, seed=ctx.seed)
    try:
        refs = train_references(ctx.model, ctx.sent, torch.cat([cx, ax[pool]]),
                                torch.cat([cy, ay[pool]]), len(cy), setup, ctx.progress)
    except ValueError as exc:
        raise AttackSkipped(str(exc)) from None
    target = {k: v.unsqueeze(0) for k, v in (ctx.received if obs.client is not None else
                                             state_dict(obs.released or obs.received)
                                             ).items()}
    target = {k: v.to(ctx.sent[k].device) for k, v in target.items()}
    ctx.shared["references"] = out = {
        "refs": refs, "x": (stacked_logits(ctx.model, target, cx)[0],
                            stacked_logits(ctx.model, refs.weights, cx)),
        "z": (stacked_logits(ctx.model, target, ax[z])[0],
              stacked_logits(ctx.model, refs.weights, ax[z])), "zy": ay[z]}
    return out


def lira(obs: Observation, ctx: AttackContext) -> MembershipScores:
    """LiRA against reference updates: online where every candidate is in and out of at
    least two references, offline always (the headline: online when possible)."""
    r = _references(obs, ctx)
    y = ctx.candidates[1]  # type: ignore[index]
    (target, refs), (tz, rz), zy = r["x"], r["z"], r["zy"]
    lira_ = LiRA(class_centered(logit_confidence(refs, y), y, logit_confidence(rz, zy), zy),
                 r["refs"].included)
    phi = class_centered(logit_confidence(target, y), y, logit_confidence(tz, zy), zy)
    scores = {"lira-offline": lira_.offline(phi)}
    if lira_.online_possible and r["refs"].included.any():
        scores["lira-online"] = lira_.online(phi)
    return MembershipScores(scores, "lira-online" if "lira-online" in scores
                            else "lira-offline")


def rmia(obs: Observation, ctx: AttackContext) -> MembershipScores:
    """RMIA against the same reference updates (online when the references hold the
    candidates, offline otherwise)."""
    r = _references(obs, ctx)
    y = ctx.candidates[1]  # type: ignore[index]
    (tx, rx), (tz, rz), zy = r["x"], r["z"], r["zy"]
    included = r["refs"].included
    online = LiRA(rx[..., 0], included).online_possible and bool(included.any())
    scores = rmia_scores(true_probability(tx, y), true_probability(rx, y), included,
                         true_probability(tz, zy), true_probability(rz, zy), online, y, zy)
    return MembershipScores({"rmia": scores}, "rmia")


def audit(obs: Observation, ctx: AttackContext) -> CanaryScores:
    """How strongly the audited weights carry each canary: the client's update, or under
    central DP the released model's change."""
    if ctx.canaries is None:
        raise AttackSkipped("no canaries were planted in this observation")
    central = ctx.settings.dp == "central"
    target = ({k: torch.from_numpy(np.asarray(obs.released[k], np.float32) - obs.sent[k])
               for k in obs.sent} if central and obs.released else ctx.update)
    keys = [k for k, _ in ctx.model.named_parameters()]
    return CanaryScores(ctx.canaries.scores(flatten(target, keys)),
                        "released model" if central else "client update")
