"""The converging inversion on a case the old optimiser missed, and DLG's honest budget."""

from __future__ import annotations

import torch
from torch import nn

from privacy.analysis.leakage_metrics import reconstruction_scores
from privacy.attacks import builtin
from privacy.attacks.inversion import InversionConfig, dlg, invert
from privacy.attacks.observation import LocalTraining
from privacy.attacks.registry import AttackContext, AttackSettings
from privacy.attacks.simulate import replay

ONE_STEP = LocalTraining(lr=0.01, momentum=0.5, weight_decay=0.0, local_epochs=1, batch_size=1)


def _seven() -> torch.Tensor:
    """A 12 x 12 'seven' in [0, 1]: a bar, a diagonal stroke and a faint cross stroke."""
    x = torch.zeros(1, 1, 12, 12)
    x[0, 0, 2, 2:10] = 1.0
    for i in range(8):
        x[0, 0, 3 + i, 9 - i // 2 - (i % 2)] = 1.0
    x[0, 0, 6, 4:8] = 0.6
    return x


def _observed(seed: int) -> tuple[nn.Module, dict, dict, torch.Tensor, torch.Tensor]:
    """A tiny untrained CNN and the update of one SGD step on the seven."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 8, 4, stride=2), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 25, 16), nn.ReLU(), nn.Linear(16, 10))
    sent = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = _seven(), torch.tensor([7])
    update = {k: v.detach() for k, v in replay(model, sent, x, y, ONE_STEP,
                                                 create_graph=False).items()}
    return model, sent, update, x, y


def test_screened_restarts_and_refinement_recover_an_image_the_old_optimiser_missed():
    # On this model the previous optimiser (signed Adam from Gaussian noise, 2 restarts
    # of 2,000 iterations, no screening or refinement: fedpriv at commit 8999fd1) ends at
    # 10.5 dB; the converging one, on a budget of 1,570 iterations, recovers the digit.
    torch.set_num_threads(1)
    model, sent, update, x, y = _observed(seed=1)
    messages: list[str] = []
    rec = invert(model, sent, update, y, ONE_STEP, (1, 12, 12),
                 InversionConfig(300, 8, 0.1, 0.01, seed=0, refine=300, keep=2),
                 progress=messages.append)
    psnr = reconstruction_scores(rec.x, rec.y, x, y)["psnr"]
    assert psnr > 25, psnr  # measured 39.0 dB
    assert rec.loss < 1e-3
    assert any("continuing the 2. closest of 8 restarts" in m for m in messages)
    assert any("refining the best restart, iteration 300/300" in m for m in messages)


def test_dlg_runs_exactly_the_iterations_asked_for_without_a_cap(monkeypatch):
    torch.set_num_threads(1)
    model, sent, update, _, y = _observed(seed=1)
    messages: list[str] = []
    dlg(model, sent, update, 1, 10, ONE_STEP, (1, 12, 12), iterations=45, labels=y,
        progress=messages.append)
    assert messages[-1] == "DLG: restart 1/1, 45/45 L-BFGS iterations"
    # the registered attack passes dlg-iterations through, however large
    seen = {}
    monkeypatch.setattr(builtin, "dlg_attack", lambda *a, **k: seen.update(k))
    monkeypatch.setattr(builtin, "_inputs", lambda obs, ctx: (1, y, False))

    class Obs:
        num_classes, training, input_shape = 10, ONE_STEP, (1, 12, 12)

    ctx = AttackContext(model=model, sent=sent, received=sent, update=update, seed=0,
                        settings=AttackSettings(dlg_iterations=5000))
    builtin.dlg(Obs(), ctx)  # type: ignore[arg-type]
    assert seen["iterations"] == 5000
