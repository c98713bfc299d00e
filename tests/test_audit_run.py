"""The whole-run audit through the real round (in-process federation): thousands of
canaries, every observed round's scores summed, four estimators and the claim check."""

from __future__ import annotations

import json

from experiments.leakage.attack import run_attacks

from .test_leakage import observed_run
from .test_strategies import _task_identity  # noqa: F401  (fixture)


def test_whole_run_audit_of_local_dpsgd_sums_rounds_and_respects_the_claim(tmp_path):
    # client 0: 50 digits + 2,000 canaries in one full batch (q = 1: a Gaussian claim)
    observed_run(tmp_path, {"leakage-rounds": "1,2", "attacks": "audit", "canaries": 2000,
                            "observed-examples": 50, "batch-size": 2050, "dp": "local",
                            "noise-multiplier": 2.0, "delta": 1e-5,
                            "audit-guess-fraction": 0.2}, rounds=2)
    summary = run_attacks(tmp_path, echo=lambda line: None)["audit"]
    lines = [json.loads(x) for x in (tmp_path / "leakage.jsonl").read_text().splitlines()]
    run = [x for x in lines if x.get("scope") == "run"]
    assert len(lines) == 3 and len(run) == 1 and run[0]["rounds"] == [1, 2]
    line = run[0]
    assert line["observations-audited"] == 3  # 2 observations + the whole run: Bonferroni
    assert line["claim-checked-by"] == "steinke, fdp, gdp, oneshot"  # full batch: Gaussian
    assert line["claim-consistent"] is True and summary["claim-consistent"] is True
    claimed = line["epsilon-claimed"]  # the cumulative epsilon through round 2
    assert claimed == max(x["epsilon-claimed"] for x in lines)
    for key in ("epsilon-lower-bound", "epsilon-lower-bound-fdp", "epsilon-estimate-gdp",
                "epsilon-lower-bound-oneshot"):
        assert 0 <= line[key] <= claimed
    # the sum of two rounds carries more signal than either round
    assert line["epsilon-estimate-gdp"] > 0.3 * claimed
    assert summary["scope"] == "run" and summary["rounds"] == [1, 2]
    text = (tmp_path / "summary.md").read_text()
    assert "rounds 1, 2 together" in text and "(Steinke)" in text
