"""The examples/ plugins, for real: a model of one's own trained in a real `fedpriv run`
(Flower's simulation runtime, the ClientApps in Ray workers) and an attack of one's own
scored like the built-in ones. Plugins register names for the whole process, so whatever
imports them runs in a child process: the registries of this test process stay fedpriv's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from experiments.configs import resolve
from tasks.config import ConfigError, validate
from tasks.results.folder import read_run_info

from .conftest import REPO, only_run, run_cli

PLUGINS = "examples.custom_model,examples.custom_attack"
TINY_MLP_PARAMETERS = 784 * 32 + 32 + 32 * 10 + 10  # on MNIST's 28x28 images, 10 classes


def _lines(run) -> dict[str, dict]:
    return {x["attack"]: x for x in map(json.loads, (run / "leakage.jsonl").read_text()
                                        .splitlines())}


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_a_name_no_plugin_registered_is_refused_and_points_to_plugins():
    with pytest.raises(ConfigError) as err:
        resolve(None, ["model=tiny-mlp"])
    text = str(err.value)
    assert "model = 'tiny-mlp' must be one of auto, cnn" in text
    assert "tasks.registry.MODELS.register in a module the plugins key names" in text


def test_a_plugin_that_does_not_import_is_named_with_the_reason_and_the_fix(tmp_path,
                                                                             monkeypatch):
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('no GPU here\\nmore')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        validate({"plugins": "no_such_plugin, broken_plugin, examples/custom_model.py"})
    text = str(err.value)
    assert ("plugins: the module 'no_such_plugin' was not found (ModuleNotFoundError: No "
            "module named 'no_such_plugin')") in text
    assert "add that folder to PYTHONPATH, or install it" in text
    assert ("plugins: importing 'broken_plugin' failed (RuntimeError: no GPU here); fix the "
            "module") in text
    assert "'examples/custom_model.py' is not a module name" in text
    assert "'examples.custom_model' for the file" in text


def test_the_custom_model_and_attack_register_in_a_process_that_names_them():
    res = _python(f"""
        from tasks.config import validate
        from tasks.models import count_parameters
        from tasks.splits import model_for
        cfg = validate({{"plugins": "{PLUGINS}", "model": "tiny-mlp", "leakage-rounds": "1",
                         "attacks": "mia,grad-norm"}})
        model, name = model_for(cfg)
        print(name, count_parameters(model))
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["tiny-mlp", str(TINY_MLP_PARAMETERS)]


def test_the_custom_attack_is_scored_like_the_built_in_ones(tmp_path):
    # a round of the real ClientApp in one process (tests/test_leakage.observed_run), then
    # `fedpriv attack`'s code: the plugin's scores go through the same scoring side
    res = _python(f"""
        from flwr.supercore.task_identity import TaskIdentity
        from pathlib import Path
        from experiments.leakage.attack import run_attacks
        from tests.test_leakage import observed_run
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        observed_run(Path({str(tmp_path)!r}), {{
            "plugins": "{PLUGINS}", "model": "tiny-mlp", "num-clients": 2,
            "leakage-rounds": "1", "attacks": "mia,grad-norm", "mia-candidates": 100}})
        run_attacks(Path({str(tmp_path)!r}), echo=print)
    """)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "round-1-client-0 grad-norm: AUC" in res.stdout
    line = _lines(tmp_path)["grad-norm"]
    assert line["attack-used"] == "grad-norm" and line["members"] == 100
    assert 0 <= line["auc"] <= 1 and set(line["attacks"]) == {"grad-norm"}
    assert (tmp_path / line["roc"]).is_file()
    summary = json.loads((tmp_path / "leakage.json").read_text())
    assert summary["grad-norm"]["auc"] == line["auc"] and "mia" in summary
    assert "- membership inference (gradient norm): AUC" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_plugins_reach_the_server_and_the_ray_workers_in_a_real_run(tmp_path, results):
    # run from the repository root, as examples/README.md says: the CLI finds examples/ in
    # the current folder, and the Flower processes get it from the CLI
    res = run_cli("run", "--set", f"plugins={PLUGINS}", "--set", "model=tiny-mlp",
                  "--set", "num-clients=2", "--set", "num-server-rounds=1",
                  "--set", "leakage-rounds=1", "--set", "attacks=grad-norm",
                  "--set", "mia-candidates=100", "--set", f"results-dir={results}")
    assert res.returncode == 0, res.stdout + res.stderr
    run = only_run(results)
    info = read_run_info(run)
    assert info["model"] == "tiny-mlp" and info["parameters"] == TINY_MLP_PARAMETERS
    assert info["status"] == "finished"
    first = _lines(run)["grad-norm"]
    assert 0 <= first["auc"] <= 1 and info["leakage"]["grad-norm"]["auc"] == first["auc"]
    # `fedpriv attack` again with the run's own plugins: the same numbers
    again = run_cli("attack", str(run), "--attack", "grad-norm,mia", cwd=tmp_path,
                    env={"PYTHONPATH": str(REPO)})
    assert again.returncode == 0, again.stdout + again.stderr
    lines = _lines(run)
    assert lines["grad-norm"]["auc"] == first["auc"] and "auc" in lines["mia"]


def _script(name: str, *args: str, tmp) -> str:
    """Run examples/NAME as a researcher would (from another folder), return its output."""
    tmp.mkdir()
    done = subprocess.run([sys.executable, str(REPO / "examples" / name), *args,
                           "--results-dir", str(tmp / "results")], cwd=tmp,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_three_study_scripts_run_and_report(tmp_path):
    out = _script("dp_tradeoff.py", "--epsilons", "2", "--rounds", "2", "--clients", "3",
                  tmp=tmp_path / "dp")
    lines = out.splitlines()
    table = lines[next(i for i, x in enumerate(lines) if "test_accuracy" in x):]
    assert table[1].split()[:3] == ["1", "local", "2.0"] and table[2].split()[1] == "none"
    assert 1.9 < float(table[1].split()[3]) <= 2.0  # the epsilon spent, within the target
    assert next((tmp_path / "dp" / "results" / "sweeps").iterdir()).joinpath(
        "tradeoff.png").is_file()

    out = _script("leakage_study.py", "--defence", "dp-local", "--rounds", "1",
                  "--clients", "3", tmp=tmp_path / "leak")
    lines = out.splitlines()
    rows = lines[next(i for i, x in enumerate(lines) if x.startswith("defence ")):]
    assert "mia auc" in rows[0] and rows[1].split()[0] == "off" and rows[2].split()[0] == "on"

    out = _script("custom_model_study.py", "--rounds", "1", "--clients", "3",
                  tmp=tmp_path / "model")
    assert "small-cnn  tiny-mlp" in out and f"tiny-mlp {TINY_MLP_PARAMETERS:,}" in out
