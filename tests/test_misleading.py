"""Runs that would mislead are refused before any work: a key the chosen mode ignores
(``target-epsilon`` without ``dp = 'local'`` trains without DP), and central DP whose noise
drowns every update (the model cannot learn, yet the run would say ``finished``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import fedpriv
from experiments.configs import resolve
from experiments.preflight.checks import preflight
from experiments.sweep.run import build_cells
from experiments.sweep.spec import SweepSpec
from privacy.dp.dpfedavg import DPFedAvg
from strategies.central_dp import central_params
from tasks.config import ConfigError, validate
from tasks.splits import model_for

from .conftest import run_cli


@pytest.mark.parametrize(("given", "says"), [
    (["target-epsilon=5"], "target-epsilon = 5 has no effect with dp = 'none': remove it, "
                           "or set dp to one of local, central"),
    (["dp=central", "dp-relation=replace-one"], "has no effect with dp = 'central'"),
    (["noise-multiplier=2"], "set dp to one of local, central"),
    (["proximal-mu=0.5"], "proximal-mu = 0.5 has no effect with strategy = 'fedavg'"),
    (["secagg-num-shares=5"], "set secure-aggregation = 'secagg+'"),
    (["dirichlet-alpha=0.1"], "no effect with partitioner = 'iid'"),
    (["features=embeddings", "anonymizer=ksame", "mask-fraction=0.3"],
     "mask-fraction = 0.3 has no effect with anonymizer = 'ksame'"),
])
def test_a_key_without_effect_is_refused_before_any_work(tmp_path, given, says):
    sets = [a for g in given for a in ("--set", g)]
    res = run_cli("run", *sets, "--set", f"results-dir={tmp_path / 'r'}", timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert says in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()  # nothing was started


def test_the_api_refuses_it_too_and_keys_that_act_pass(tmp_path):
    with pytest.raises(ConfigError, match="target-epsilon = 5 has no effect"):
        fedpriv.run(target_epsilon=5, results_dir=str(tmp_path))
    assert not list(tmp_path.iterdir())
    cfg = resolve(None, ["dp=local", "target-epsilon=5", "proximal-mu=0.01"])
    assert cfg.privacy.target_epsilon == 5  # proximal-mu = its default: nothing was set


def test_a_sweep_labels_cells_only_by_keys_that_act_in_them():
    spec = SweepSpec("s", None, {"num-clients": 3},  # type: ignore[arg-type]
                     {"dp": ["none", "local"], "target-epsilon": [1.0, 5.0]})
    cells = build_cells(spec, {})
    labels = [c.label for c in cells]
    assert labels == ["dp=none", "dp=none", "dp=local, target-epsilon=1.0",
                      "dp=local, target-epsilon=5.0"], labels
    # --set proximal-mu acts in no cell: refused as `fedpriv run` refuses it
    # (load_sweep puts --set in every cell's base)
    spec.base["proximal-mu"] = 0.1
    with pytest.raises(ConfigError, match="proximal-mu = 0.1 has no effect"):
        build_cells(spec, {"proximal-mu": 0.1})
    # target-epsilon acts in the local cells: accepted
    del spec.base["proximal-mu"]
    spec.base["target-epsilon"] = 2.0
    spec.grid.pop("target-epsilon")
    assert [c.label for c in build_cells(spec, {"target-epsilon": 2.0})] == [
        "dp=none", "dp=local"]


def _noise_to_signal_monte_carlo(cfg, weights: int, draws: int = 20) -> float:
    """Mean length of the noise DP-FedAvg actually adds to an all-zero averaged update,
    over the clipping norm (the longest the average of clipped updates can be)."""
    mech = DPFedAvg(central_params(cfg, cfg.federation.num_clients), seed=1)
    lengths = [math.sqrt(sum(float(np.sum(a ** 2)) for a in mech.release(
        r, [np.zeros(weights)]).update)) for r in range(1, draws + 1)]
    return float(np.mean(lengths)) / cfg.privacy.clipping_norm


def test_central_dp_that_drowns_the_update_is_refused_with_the_figure(tmp_path):
    cfg = validate({"dp": "central", "results-dir": str(tmp_path)})  # the defaults
    weights = sum(p.numel() for p in model_for(cfg)[0].parameters())
    ratio = _noise_to_signal_monte_carlo(cfg, weights)
    assert ratio == pytest.approx(16.1, rel=0.03)  # z sqrt(26,010) / 10, measured
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    text = str(err.value)
    assert "expected to be 16.1x longer" in text, text
    assert "max-noise-to-signal = 10" in text and "noise-multiplier (to 0.62" in text
    # the escape hatch, and a setting that trains (z = 0.5: 73% in 10 rounds)
    preflight(validate({"dp": "central", "max-noise-to-signal": 0,
                        "results-dir": str(tmp_path)}))
    ok = validate({"dp": "central", "noise-multiplier": 0.5, "results-dir": str(tmp_path)})
    assert "noise 8.1x the longest averaged update" in preflight(ok).privacy
    assert _noise_to_signal_monte_carlo(ok, weights) == pytest.approx(8.06, rel=0.03)


def test_the_cifar10_preset_asks_for_its_data_instead_of_blaming_a_folder(tmp_path):
    res = run_cli("run", "--config", "cifar10", "--set", f"results-dir={tmp_path / 'r'}",
                  cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "cifar10 needs a data-dir holding torchvision's layout" in res.stderr
    assert "does not exist" not in res.stderr  # no data-dir the user never set
    assert [p.name for p in tmp_path.rglob("*")] in ([], ["r"])  # at most results-dir


def test_a_failed_download_leaves_no_empty_folder_behind(tmp_path):
    # a proxy nobody listens on: the download fails at once, online or not
    closed = {v: "http://127.0.0.1:9" for v in ("http_proxy", "https_proxy", "HTTP_PROXY",
                                                  "HTTPS_PROXY")}
    res = run_cli("run", "--config", "cifar10", "--set", "data-dir=data/cifar",
                  "--set", "download=true", "--set", f"results-dir={tmp_path / 'r'}",
                  cwd=tmp_path, timeout=120, env={**closed, "no_proxy": "", "NO_PROXY": ""})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Reading or downloading CIFAR10" in res.stderr
    assert [p.name for p in tmp_path.rglob("*")] in ([], ["r"])  # at most results-dir
