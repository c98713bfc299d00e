"""The server's round loop with real strategies and the real ClientApp (in this process):
stop conditions, hooks, and the ledger they write."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from server.evaluation import CentralEvaluator
from server.loop import run_rounds, target_accuracy_reached
from server.privacy_log import AnonymizationLog, PrivacyLog
from server.recorder import RoundRecorder
from strategies.build import build_runner
from tasks.config import validate
from tasks.results.folder import RunFolder
from tasks.results.info import RunInfo
from tasks.results.ledger import read_ledger
from tasks.splits import heldout_split, model_for
from tasks.training import resolve_device

from .inprocess import InProcessGrid
from .test_strategies import _task_identity  # noqa: F401  (fixture)


class Hook:
    def __init__(self):
        self.rounds, self.finished = [], 0

    def after_round(self, record, arrays, result):
        self.rounds.append(record.round)

    def finish(self):
        self.finished += 1


def _loop(tmp_path, cfg, num_rounds, stops=None):
    """Run the loop in-process; ``stops(privacy_log, central_privacy)`` gives its stop
    conditions."""
    grid = InProcessGrid(cfg)
    runner = build_runner(cfg, grid, grid.partition_of)
    torch.manual_seed(cfg.training.seed)  # as the ServerApp does: the same start every run
    model, _ = model_for(cfg)
    central = runner.central
    privacy = PrivacyLog(cfg, central, cfg.federation.num_clients)
    run = RunFolder(tmp_path)
    recorder = RoundRecorder(run, RunInfo(), privacy, AnonymizationLog("none"))
    hook = Hook()
    out = run_rounds(runner, ArrayRecord(model.state_dict()), num_rounds,
                     CentralEvaluator(model, heldout_split(cfg), 512, resolve_device("cpu")),
                     recorder, hooks=[hook], **(stops(privacy, central) if stops else {}))
    return out, read_ledger(tmp_path), hook


def test_the_run_stops_when_every_client_is_out_of_budget(tmp_path):
    # Budgets planned for 2 rounds of everyone; the loop is asked for 5: in round 3 every
    # client declines, the round is recorded, and the run stops with the reason.
    cfg = validate({"num-clients": 3, "num-server-rounds": 2, "dp": "local",
                    "target-epsilon": 2.0, "batch-size": 128})
    out, ledger, hook = _loop(tmp_path, cfg, 5, stops=lambda privacy, central: {
        "stop_after": [lambda r: privacy.stop_reason(r.round)]})
    assert [r.round for r in ledger] == [1, 2, 3] and hook.rounds == [1, 2, 3]
    assert [len(r.clients) for r in ledger] == [3, 3, 0]
    assert [c["partition-id"] for c in ledger[2].skipped] == [0, 1, 2]
    assert "every client has spent its privacy budget" in out.stopped_early
    assert max(ledger[-1].privacy["epsilon"].values()) <= 2.0
    assert ledger[2].test == ledger[1].test  # nobody trained: the model did not move
    assert hook.finished == 1


def test_target_accuracy_and_max_epsilon_stop_the_loop_explicitly(tmp_path):
    cfg = validate({"num-clients": 3, "lr": 0.1})
    out, ledger, _ = _loop(tmp_path / "a", cfg, 10, stops=lambda privacy, central: {
        "stop_after": [target_accuracy_reached(0.8)]})
    assert out.stopped_early and "reached target-accuracy 0.8" in out.stopped_early
    assert 2 <= len(ledger) < 10  # round 1 reaches about 0.54, not yet the target
    assert ledger[-1].accuracy >= 0.8 > max(r.accuracy for r in ledger[:-1])

    # (a small clipping norm keeps the noisy model finite; epsilon does not depend on it)
    dp = validate({"num-clients": 3, "dp": "central", "noise-multiplier": 5.0,
                   "clipping-norm": 0.01, "max-epsilon": 1.5})
    out, ledger, _ = _loop(tmp_path / "b", dp, 10, stops=lambda privacy, central: {
        "stop_before": [central.stop_reason]})
    assert "past max-epsilon = 1.5" in out.stopped_early
    assert all(r.privacy["epsilon"] <= 1.5 for r in ledger) and len(ledger) < 10


def test_client_side_adaptive_clipping_runs_through_the_real_clients(tmp_path):
    cfg = validate({"num-clients": 4, "dp": "central", "central-clipping": "client-adaptive",
                    "noise-multiplier": 0.1, "clipping-norm": 0.01})
    _, ledger, _ = _loop(tmp_path, cfg, 3)
    norms = [r.privacy["clipping-norm"] for r in ledger]
    # every update is longer than 0.01, so every client reports unclipped = 0 and C grows
    assert all(c["unclipped"] == 0 and c["update-norm"] > 0.01 for r in ledger
               for c in r.clients)
    assert norms == sorted(norms) and norms[-1] > 0.01 * 1.1 ** 2
    assert ledger[-1].privacy["releases"] == 3 and ledger[-1].privacy["epsilon"] > 0



def _record(test_loss: float, train_loss: float | None = 0.5, rnd: int = 3):
    from tasks.results.ledger import RoundRecord

    return RoundRecord(round=rnd, test={"accuracy": 0.1, "loss": test_loss},
                       train={} if train_loss is None else {"loss": train_loss},
                       sampled=[0], clients=[], failures=[], time={})


def test_a_diverged_model_is_told_apart_with_its_cause():
    from server.loop import diverged

    assert diverged(_record(2.0), 2.3) is None and diverged(_record(20.0, None), 2.3) is None
    assert diverged(_record(float("nan")), 2.3) == "the test loss is nan"
    assert "train loss is inf" in diverged(_record(1.0, float("inf")), 2.3)
    assert "test loss 30 is over 10x" in diverged(_record(30.0), 2.3)
    assert "train loss 5e+31 is over 10x" in diverged(_record(4.0, 5e31), 2.3)
    assert diverged(_record(30.0), None) is None  # no initial loss: non-finite only


def test_the_watch_records_the_first_diverged_round_once_and_the_run_goes_on():
    from server.loop import DivergenceWatch

    seen = []
    watch = DivergenceWatch(lambda: 2.3, lambda rnd, cause: seen.append((rnd, cause)))
    for rnd, loss in ((1, 2.0), (2, float("nan")), (3, float("nan"))):
        watch.after_round(_record(loss, rnd=rnd), None, None)
    assert seen == [(2, "the test loss is nan")]


def test_the_table_keeps_its_columns_when_a_loss_explodes():
    from server.console import table_header, table_row

    width = len(table_header())
    for loss in (0.25, 5.05e31, float("nan"), float("inf")):
        row = table_row(4, {"accuracy": 0.1, "loss": loss}, {"loss": loss}, "10/10", 0.5)
        assert len(row) == width, row


def test_a_tampered_rounds_train_loss_is_not_the_models():
    from server.loop import diverged

    rec = _record(2.0, 1e9)
    rec.tampered = "binning"
    assert diverged(rec, 2.3) is None
