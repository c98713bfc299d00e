"""Federated training on anonymized embeddings, end to end (real Flower runtime). Slow."""

from __future__ import annotations

import csv
import json

import pytest

from tasks.results.folder import read_run_info

from .conftest import ledger_json, only_run, run_cli

pytestmark = pytest.mark.slow


def test_density_ksame_cvae_and_federated_cvae_runs(tmp_path, results):
    sweep = tmp_path / "anon.toml"
    sweep.write_text(f"""
name = "anon"
[fixed]
features = "embeddings"
num-clients = 3
num-server-rounds = 2
lr = 0.1
backbone-epochs = 1
cvae-epochs = 40
cvae-rounds = 2
cvae-local-epochs = 5
results-dir = "{results}"
[[cells]]
anonymizer = "density"
density-classwise = true
[[cells]]
anonymizer = "ksame"
k = 5
[[cells]]
anonymizer = "cvae"
[[cells]]
anonymizer = "cvae-federated"
[[cells]]
anonymizer = "identity"
""")
    res = run_cli("sweep", str(sweep), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    out = only_run(results / "sweeps")
    rows = {r["anonymizer"]: r for r in csv.DictReader(open(out / "sweep.csv"))}
    assert set(rows) == {"density", "ksame", "cvae", "cvae-federated", "identity"}
    for name, row in rows.items():
        run = out / row["run-dir"]
        assert row["status"] == "finished", (name, row["error"])
        records = ledger_json(run)
        assert len(records) == 2
        anon = records[-1]["anonymization"]
        assert anon["anonymizer"] == name and len(anon["clients"]) == 3
        assert records[-1]["test"]["accuracy"] > 0.3, name  # real test embeddings, 10 classes
        assert (run / "plots" / "release_scatter.png").is_file()
        assert "](plots/release_scatter.png)" in (run / "summary.md").read_text()  # shown
        info = read_run_info(run)
        assert "public 20% split of mnist" in info["backbone"]["trained-on"]
    mean = {n: read_run_info(out / r["run-dir"])["anonymization"]["mean"]
            for n, r in rows.items()}
    assert mean["identity"]["reid-top1"] == 1.0
    assert mean["ksame"]["reid-top1"] <= 0.2 + 1e-9 and mean["ksame"]["k-level"] == 5
    assert mean["density"]["k-level"] >= 5  # every cluster has min-samples members
    for synthetic in ("cvae", "cvae-federated"):
        assert mean[synthetic]["reid-top1"] < mean["identity"]["reid-top1"]
        assert mean[synthetic]["overlap"] == 0.0
    phase = read_run_info(out / rows["cvae-federated"]["run-dir"])["cvae-phase"]
    assert phase["rounds"] == 2 and len(phase["clients"]) == 3
    cvae_log = (out / rows["cvae-federated"]["run-dir"] / "cvae.jsonl").read_text()
    assert len([json.loads(x) for x in cvae_log.splitlines()]) == 2
    for plot in ("reid_accuracy.png", "mia_accuracy.png"):
        assert (out / "plots" / plot).is_file()
