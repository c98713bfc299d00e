"""The leakage study in real runs (Flower simulation runtime, Ray): `fedpriv run` observes
and attacks, `fedpriv attack` reproduces it; under SecAgg+ there is nothing per client
to attack. Marked slow."""

from __future__ import annotations

import json

import pytest

from tasks.results.folder import read_run_info

from .conftest import only_run, run_cli

pytestmark = pytest.mark.slow


def _lines(run):
    return {x["attack"]: x for x in map(json.loads, (run / "leakage.jsonl").read_text()
                                        .splitlines())}


def test_a_run_attacks_what_its_server_saw_and_fedpriv_attack_reproduces_it(tmp_path, results):
    res = run_cli("run", "--set", "num-clients=3", "--set", "num-server-rounds=1",
                  "--set", "leakage-rounds=1", "--set", "observed-examples=1",
                  "--set", "batch-size=1", "--set", "attacks=labels,invert",
                  "--set", "invert-iterations=1000", "--set", f"results-dir={results}",
                  cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "round 1: observed client 0 (observations/)" in res.stdout
    assert "inverting: continuing the 2. closest of 8 restarts, iteration 1000/1000" \
        in res.stdout  # progress
    run = only_run(results)
    first = _lines(run)
    assert first["labels"]["label-accuracy"] == 1.0
    assert first["invert"]["psnr"] > first["invert"]["psnr-random"] + 12
    assert read_run_info(run)["leakage"]["invert"]["psnr"] == first["invert"]["psnr"]
    assert "## What leaked" in (run / "summary.md").read_text()
    assert (run / "plots" / "leakage" / "round-1-client-0-invert.png").is_file()

    again = run_cli("attack", str(run), "--attack", "invert,labels", "--round", "1",
                    cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    second = _lines(run)
    for key in ("psnr", "ssim", "label-accuracy", "objective"):
        assert second["invert"][key] == first["invert"][key], key


def test_secure_aggregation_leaves_only_the_aggregate_to_attack(tmp_path, results):
    res = run_cli("run", "--set", "num-clients=3", "--set", "num-server-rounds=1",
                  "--set", "secure-aggregation=true", "--set", "leakage-rounds=1",
                  "--set", "leakage-clients=aggregate", "--set", "attacks=mia",
                  "--set", "mia-candidates=100", "--set", f"results-dir={results}",
                  cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    run = only_run(results)
    assert sorted(p.name for p in (run / "observations").iterdir()) == [
        "round-1-aggregate.json", "round-1-aggregate.npz"]
    mia = _lines(run)["mia"]
    assert mia["client"] == "aggregate" and "update-loss" not in mia["attacks"]
    refused = run_cli("attack", str(run), "--attack", "invert", cwd=tmp_path)
    assert refused.returncode == 2
    assert "saw only the aggregate" in refused.stderr and "Traceback" not in refused.stderr

    per_client = run_cli("run", "--set", "secure-aggregation=true", "--set", "num-clients=3",
                         "--set", "leakage-rounds=1", "--set", f"results-dir={results}",
                         cwd=tmp_path)
    assert per_client.returncode == 2
    assert "never sees one client's update" in per_client.stderr
