"""Privacy in real federated runs (Flower simulation runtime, Ray, Opacus). Marked slow."""

from __future__ import annotations

import csv
import json
import random
from collections import Counter

import numpy as np
import pytest
import torch
from dp_accounting import GaussianDpEvent, NeighboringRelation
from dp_accounting.pld import PLDAccountant

from privacy.dp.disclosure import IDENTITY, RECORD_COUNT, SENT_WEIGHTS
from tasks.results.folder import read_run_info
from tasks.seeding import sampling_seed

from .conftest import fresh_epsilon, ledger_json, only_run, run_cli
from .dp_reference import gaussian_epsilon

pytestmark = pytest.mark.slow


def _seed_with_oversampling(rounds, clients, planned):
    """A seed under which some client is sampled more often than it planned for."""
    for seed in range(200):
        picks = [random.Random(sampling_seed(seed, r, 0)).sample(range(clients), 1)[0]
                 for r in range(1, rounds + 1)]
        if max(Counter(picks).values()) > planned:
            return seed
    raise AssertionError("no such seed")


def _central_reference(k):
    """Client-level epsilon after k rounds of 2-of-4 central DP at z = 1 (dp-accounting
    directly, not fedpriv's accountant): one client joining can displace another, so each
    round is a Gaussian mechanism with multiplier z / 2 = 0.5 at delta 1e-5; PLD, the
    default accountant."""
    acc = PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(GaussianDpEvent(0.5), k)
    return acc.get_epsilon(1e-5)


def _secagg_picks():
    """Seed 0 samples client 0 in all 4 rounds (2 of 3 a round); it planned for 3."""
    return [sorted(random.Random(sampling_seed(0, r, 0)).sample(range(3), 2))
            for r in range(1, 5)]


def _extra_cells():
    """The three longer DP runs, each told apart in sweep.csv by (num-server-rounds, dp,
    secure-aggregation): ("5", "local", "False"), ("3", "central", "False"),
    ("4", "local", "True"). The central run's clipping norm keeps its noise (z C / 2 per
    coordinate) small enough that training stays finite on every CPU: at C = 0.5 the noisy
    model's next round overflowed to NaN on some machines; epsilon does not depend on C."""
    local = {"dp": "local", "target-epsilon": 2.0, "batch-size": 64,
             "central-clipping": "server-fixed"}
    return [
        {**local, "num-clients": 3, "fraction-train": 0.34, "num-server-rounds": 5,
         "seed": _seed_with_oversampling(rounds=5, clients=3, planned=2),
         "secure-aggregation": False},
        {"num-clients": 4, "fraction-train": 0.5, "num-server-rounds": 3, "dp": "central",
         "noise-multiplier": 1.0, "clipping-norm": 0.05, "central-clipping": "server-fixed",
         "target-epsilon": 0.0, "max-noise-to-signal": 0,
         "max-epsilon": (_central_reference(2) + _central_reference(3)) / 2,
         "fraction-evaluate": 0.5, "seed": 42, "secure-aggregation": False},
        {**local, "num-clients": 3, "fraction-train": 0.67, "num-server-rounds": 4,
         "secure-aggregation": True, "seed": 0},
    ]


def _privacy_sweep(tmp_path_factory):
    """(sweep folder, its rows): the secure-aggregation grid (one round each) and the
    three longer DP runs of the tests below, in one simulation."""
    tmp = tmp_path_factory.mktemp("privacy")
    results = tmp / "results"
    cells = "".join("[[cells]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in c.items())
                    for c in _extra_cells())
    sweep = tmp / "secure.toml"
    sweep.write_text(f"""
name = "secure"
[fixed]
num-clients = 3
num-server-rounds = 1
central-clipping = "client-fixed"
target-epsilon = 5.0
max-noise-to-signal = 0  # 3 clients cannot average central DP's noise away
seed = 5
results-dir = "{results}"
[grid]
dp = ["none", "local"]
secure-aggregation = [false, true, "he"]
[[cells]]
dp = "central"
secure-aggregation = true
[[cells]]
dp = "central"
secure-aggregation = "he"
""" + cells)
    res = run_cli("sweep", str(sweep), cwd=tmp)
    assert res.returncode == 0, res.stdout + res.stderr
    out = only_run(results / "sweeps")
    return out, list(csv.DictReader(open(out / "sweep.csv")))


def _cell(privacy_sweep, key):
    out, rows = privacy_sweep
    (row,) = [r for r in rows if (r["num-server-rounds"], r["dp"], r["secure-aggregation"])
              == key]
    assert row["status"] == "finished", row
    return out / row["run-dir"]


def _local_dp_accounting_budget_and_exhaustion(privacy_sweep):
    run = _cell(privacy_sweep, ("5", "local", "False"))
    records = ledger_json(run)
    assert len(records) == 5 and read_run_info(run)["status"] == "finished"
    trained: Counter = Counter()
    last = {}
    for r in records:
        (pid,) = r["sampled"]
        spent = {int(k): v for k, v in r["privacy"]["epsilon"].items()}
        for other, eps in last.items():
            if other != pid:  # a client that was not sampled spent nothing this round
                assert spent[other] == eps
        for c in r["clients"] + r.get("skipped", []):  # nothing unaccounted reached the server
            assert set(c) <= IDENTITY | RECORD_COUNT, set(c) - IDENTITY - RECORD_COUNT
        if r["clients"]:
            (c,) = r["clients"]
            trained[pid] += 1
            # the public size N = 4,000 // 3 = 1,333: ceil(N / 64) Poisson batches per
            # epoch at q = 64 / N, whatever the client's own n
            steps = 21 * trained[pid]
            assert c["sample-rate"] == pytest.approx(64 / 1333) and c["num-examples"] == 1333
            assert c["dp-steps"] == steps and c["delta"] == pytest.approx(1 / 13330)
            expected = fresh_epsilon([(c["noise-multiplier"], c["sample-rate"], steps)],
                                     c["delta"], "pld")
            assert c["epsilon"] == pytest.approx(expected, rel=1e-6)
            assert c["epsilon"] <= 2.0
        else:  # the client had planned for 2 rounds: a 3rd would exceed its budget
            assert r["skipped"][0]["partition-id"] == pid and trained[pid] == 2
            assert pid in r["privacy"]["exhausted"]
        last = spent
    assert max(r["privacy"]["epsilon-max"] for r in records) <= 2.0
    summary = (run / "summary.md").read_text()
    assert "ran out of budget" in summary and (run / "plots" / "epsilon.png").is_file()
    assert read_run_info(run)["privacy"]["clients-out-of-budget"] >= 1


def _central_dp_accounting_and_max_epsilon_stop(privacy_sweep):
    eps = [_central_reference(k) for k in (1, 2, 3)]
    assert all(gaussian_epsilon(np.sqrt(k) * 2.0, 1e-5) <= e for k, e in zip((1, 2, 3), eps,
                                                                              strict=True))
    run = _cell(privacy_sweep, ("3", "central", "False"))
    records = ledger_json(run)
    assert [r["privacy"]["epsilon"] for r in records] == pytest.approx(eps[:2])
    assert all(r["privacy"]["cohort"] == 2 and r["privacy"]["delta"] == 1e-5 for r in records)
    for r in records:  # client evaluation works under central DP, weighted per example
        evals = r["client-eval"]["clients"]
        assert len(evals) == 2 and r["client-eval"]["accuracy"] == pytest.approx(
            sum(c["eval-accuracy"] * c["num-examples"] for c in evals)
            / sum(c["num-examples"] for c in evals))
    info = read_run_info(run)
    assert info["status"] == "finished" and "max-epsilon" in info["stopped-early"]
    summary = (run / "summary.md").read_text()
    assert "server still sees raw updates" in summary
    assert "neighbours: add or remove one client" in summary


def _secure_aggregation_matches_plain_and_combines_with_dp(privacy_sweep):
    out, all_rows = privacy_sweep
    given = {"False": "off", "True": "secagg+", "he": "he"}  # the sweep file's values
    rows = {(r["dp"], given[r["secure-aggregation"]]): r
            for r in all_rows  # the one-round cells (the table shows the fixed rounds)
            if r["num-server-rounds"] == "1"}
    assert len(rows) == 8
    assert all(r["status"] == "finished" for r in rows.values())
    step = 2 * 8.0 / 4194304  # SecAgg+ quantization step: 2 * clipping-range / levels
    # the clients' sizes, as the plain run's replies reported them (in simulation the
    # server assigns partitions and asks nobody for sizes up front)
    sizes = [c["num-examples"] for c in ledger_json(out / rows[("none", "off")]["run-dir"]
                                                    )[0]["clients"]]
    assert sum(sizes) == 4000
    for dp, max_weight in (("none", 4000), ("local", 4000)):
        # same clients, same seeds: only quantization differs. Each of the k updates is
        # rounded by at most one step per coordinate, and the sum is divided by the sum of
        # the weights n_i / max-weight (max-weight: the training set, which bounds every
        # client without asking any; secagg-max-weight can set a tighter one).
        plain = torch.load(out / rows[(dp, "off")]["run-dir"] / "model.pt")["state-dict"]
        secure = torch.load(out / rows[(dp, "secagg+")]["run-dir"] / "model.pt")["state-dict"]
        worst = max((plain[k] - secure[k]).abs().max().item() for k in plain)
        assert worst <= len(sizes) * step / (sum(sizes) / max_weight) + 1e-6, (dp, worst)
        # CKKS: the same aggregate to within its precision (privacy.encryption.ckks)
        he = torch.load(out / rows[(dp, "he")]["run-dir"] / "model.pt")["state-dict"]
        worst = max((plain[k].double() - he[k].double()).abs().max().item() for k in plain)
        assert worst <= 1e-6, (dp, worst)
    for (dp, sec), row in rows.items():
        info = read_run_info(out / row["run-dir"])
        assert info["aggregation"]["individual-updates-visible"] is (sec == "off")
        assert row["server-sees"] == ("each update" if sec == "off" else
                                      f"the sum only ({info['aggregation']['protocol']})")
        if sec != "off":
            assert info["aggregation"]["protocol"] == (
                "SecAgg+" if sec == "secagg+" else "CKKS homomorphic encryption (TenSEAL)")
            # only identity and whether a client refused the weights (a function of what
            # the server sent), and with local DP the record-count-derived DP status
            allowed = IDENTITY | SENT_WEIGHTS | (RECORD_COUNT if dp == "local" else set())
            assert set(info["aggregation"]["client-values-in-clear"]) == allowed
            for record in ledger_json(out / row["run-dir"]):
                for client in record["clients"]:  # (upload-bytes: measured by the server)
                    sent = set(client) - {"upload-bytes"}
                    assert sent <= allowed, (dp, sec, sent - allowed)
            parts = json.loads((out / row["run-dir"] / "partitions.json").read_text())
            assert all("label-counts" not in p for p in parts["clients"])
            assert (out / row["run-dir"] / "plots" / "label_distribution.png").is_file()
    central = ledger_json(out / rows[("central", "secagg+")]["run-dir"])[0]
    assert central["privacy"]["releases"] == 1 and central["privacy"]["epsilon"] > 0
    assert "quantization" in central["privacy"]["accounting"]
    he_central = ledger_json(out / rows[("central", "he")]["run-dir"])[0]
    assert he_central["privacy"]["releases"] == 1
    # CKKS's encoding slack is far smaller than SecAgg+'s quantization slack
    assert 0 < he_central["privacy"]["epsilon"] <= central["privacy"]["epsilon"]


def _secure_aggregation_records_clients_out_of_local_dp_budget(privacy_sweep):
    picks = _secagg_picks()
    assert all(0 in p for p in picks)
    run = _cell(privacy_sweep, ("4", "local", "True"))
    records = ledger_json(run)
    assert len(records) == 4 and read_run_info(run)["status"] == "finished"
    for r, sampled in zip(records[:3], picks[:3], strict=True):
        assert [c["partition-id"] for c in r["clients"]] == sampled and "skipped" not in r
    last = records[3]
    assert [c["partition-id"] for c in last["skipped"]] == [0]
    assert [c["partition-id"] for c in last["clients"]] == [p for p in picks[3] if p != 0]
    assert last["privacy"]["exhausted"] == [0] and not last["failures"]
    # The skipped client spent nothing more; the other one kept training.
    assert last["privacy"]["epsilon"]["0"] == records[2]["privacy"]["epsilon"]["0"] <= 2.0
    assert last["test"]["accuracy"] > 0.1
    info = read_run_info(run)
    assert info["aggregation"]["protocol"] == "SecAgg+"
    assert info["privacy"]["clients-out-of-budget"] == 1
    assert "ran out of budget" in (run / "summary.md").read_text()


def test_privacy_in_real_runs(tmp_path_factory):
    """One sweep in one simulation, then each check on its cells (every failing check is
    reported, not only the first)."""
    sweep = _privacy_sweep(tmp_path_factory)
    failed = []
    for check in (_local_dp_accounting_budget_and_exhaustion,
                  _central_dp_accounting_and_max_epsilon_stop,
                  _secure_aggregation_matches_plain_and_combines_with_dp,
                  _secure_aggregation_records_clients_out_of_local_dp_budget):
        try:
            check(sweep)
        except AssertionError as exc:
            failed.append(f"{check.__name__.strip('_')}: {exc}")
    assert not failed, "\n\n".join(failed)
