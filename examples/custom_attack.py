"""An attack of your own: membership inference by gradient norm, scored like fedpriv's.

From the repository root::

    fedpriv run --set plugins=examples.custom_attack --set leakage-rounds=1 \\
        --set attacks=mia,grad-norm
    fedpriv attack RUN_FOLDER --set plugins=examples.custom_attack --attack grad-norm

An attack takes what the server holds of one observed round — the
:class:`~privacy.attacks.observation.Observation` (weights sent, weights returned, the
training configuration, what the client disclosed) — and an
:class:`~privacy.attacks.registry.AttackContext` with the same weights as tensors, the
model's architecture and, for membership inference, the candidate records (half of them
the client's, shuffled). It never sees who was a member: fedpriv's scoring side, which
alone reads the clients' data, turns the scores into ROC AUC and TPR at low FPR in
leakage.jsonl, leakage.json and summary.md, as for its own ``mia``.

The signal (Nasr, Shokri & Houmansadr 2019): a model fits the records it was trained on,
so their loss gradients at the returned weights are smaller than a stranger's.
"""

from __future__ import annotations

from privacy.attacks.observation import Observation
from privacy.attacks.registry import ATTACKS, AttackContext, MembershipScores


@ATTACKS.register("grad-norm", scored_as="membership", aggregate=True,
                  title="membership inference (gradient norm)",
                  description="membership by each candidate's loss-gradient norm at the "
                              "returned weights (smaller: more likely a member)")
def gradient_norm(obs: Observation, ctx: AttackContext) -> MembershipScores:
    """Minus the norm of each candidate's loss gradient at the weights that came back
    (the client's, or under secure aggregation the new aggregate)."""
    import torch  # imported when the attack runs, not when the config is checked
    from torch.func import functional_call, grad, vmap

    assert ctx.candidates is not None
    x, y = ctx.candidates
    model = ctx.model
    params = {k: ctx.received[k].detach() for k, _ in model.named_parameters()}
    buffers = dict(model.named_buffers())
    device = next(iter(params.values())).device

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0))

    per_record = vmap(grad(loss), in_dims=(None, 0, 0))
    norms = []
    for i in range(0, len(y), 256):
        g = per_record(params, x[i:i + 256].to(device), y[i:i + 256].to(device))
        norms.append(sum(v.flatten(1).pow(2).sum(1) for v in g.values()).sqrt().cpu())
    scores = -torch.cat(norms) if norms else torch.zeros(0)
    return MembershipScores({"grad-norm": scores}, headline="grad-norm")
