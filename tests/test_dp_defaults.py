"""DP-SGD's own training settings (experiments/dp_defaults.py): which local-DP runs get them,
which keep their own, the smaller step at a small budget, the hint where none are tuned,
and the note that says what was chosen. Fast: no run starts (the end-to-end check is
tests/test_readme.py's DP command)."""

from __future__ import annotations

import pytest

from experiments.configs import resolve
from experiments.dp_defaults import SMALL_BUDGET_LR, TUNED_KEYS, dp_sgd_settings

MNIST_DP_SGD = {"batch-size": 64, "max-grad-norm": 0.5, "lr": 1.0}  # README, PRIVACY.md
PLAIN = {"batch-size": 32, "max-grad-norm": 1.0, "lr": 0.05}  # plain SGD's defaults


def _trained_with(cfg) -> dict:
    flat = cfg.flat()
    return {k: flat[k] for k in TUNED_KEYS}


@pytest.mark.parametrize("dataset", ["mnist", "fashion-mnist"])
@pytest.mark.parametrize("model", ["auto", "small-cnn"])
def test_a_local_dp_run_on_the_small_cnn_gets_the_sweeps_settings_and_says_so(dataset, model):
    settings, note = dp_sgd_settings({"dp": "local", "dataset": dataset, "model": model,
                                      "target-epsilon": 5})
    assert settings == MNIST_DP_SGD
    # the note names each setting with its value, the dataset, and how to choose one's own
    for key, value in MNIST_DP_SGD.items():
        assert f"{key} = {value}" in note, note
    assert dataset in note and "Set any of the three to choose your own" in note, note


@pytest.mark.parametrize("budget, lr", [({"target-epsilon": 5}, 1.0),
                                        ({"target-epsilon": 1}, SMALL_BUDGET_LR)])
def test_a_local_dp_mlp_on_mnist_gets_the_same_settings_with_its_own_evidence(budget, lr):
    """The dp-mlp-mnist sweep: the small CNN's settings reach 81% on the MLP at epsilon 5
    where plain SGD's reach 72% (and the smaller step is better at epsilon 1 there too)."""
    settings, note = dp_sgd_settings({"dp": "local", "dataset": "mnist", "model": "mlp",
                                      **budget})
    assert settings == {**MNIST_DP_SGD, "lr": lr}
    assert "for mnist with model 'mlp'" in note and "72% instead of 81%" in note, note


def test_the_defaults_are_mnist_and_its_model():
    """A run that names neither dataset nor model is the default MNIST small-CNN run."""
    assert dp_sgd_settings({"dp": "local", "target-epsilon": 5})[0] == MNIST_DP_SGD


@pytest.mark.parametrize("dp", [None, "none", "central", "distributed"])
def test_a_run_without_local_dp_keeps_plain_sgds_settings_and_no_note(dp):
    values = {"target-epsilon": 5} if dp is None else {"dp": dp}
    assert dp_sgd_settings(values) == ({}, None)


@pytest.mark.parametrize("key, value", [("batch-size", 128), ("max-grad-norm", 2.0),
                                        ("lr", 0.3)])
def test_a_run_that_sets_one_of_the_three_keeps_all_its_own(key, value, capsys):
    assert dp_sgd_settings({"dp": "local", "target-epsilon": 5, key: value}) == ({}, None)
    # as the config resolves it: that key as given, the other two plain SGD's, nothing said
    cfg = resolve(None, ["dp=local", "target-epsilon=5", f"{key}={value}"])
    assert _trained_with(cfg) == {**PLAIN, key: value}
    assert "DP-SGD" not in capsys.readouterr().out


def test_a_preset_that_sets_one_of_the_three_keeps_its_own(tmp_path, capsys):
    preset = tmp_path / "mine.toml"
    preset.write_text('dataset = "mnist"\nlr = 0.3\n')
    cfg = resolve(str(preset), ["dp=local", "target-epsilon=5"])
    assert _trained_with(cfg) == {**PLAIN, "lr": 0.3}
    assert "DP-SGD" not in capsys.readouterr().out


def test_resolve_applies_the_settings_and_prints_the_note(capsys):
    cfg = resolve(None, ["dp=local", "target-epsilon=5"])
    assert _trained_with(cfg) == MNIST_DP_SGD
    out = capsys.readouterr().out
    assert "using DP-SGD's settings for mnist" in out, out
    assert "batch-size = 64, max-grad-norm = 0.5, lr = 1.0" in out, out


@pytest.mark.parametrize("budget, lr", [
    ({"target-epsilon": 1}, SMALL_BUDGET_LR),
    ({"target-epsilon": 1.99}, SMALL_BUDGET_LR),
    ({"target-epsilon": 2}, 1.0),  # "0.25 under epsilon 2"
    ({"target-epsilon": 10}, 1.0),
    ({"noise-multiplier": 4.0}, SMALL_BUDGET_LR),  # sigma 4: about epsilon 1 (PRIVACY.md)
    ({"noise-multiplier": 2.0}, SMALL_BUDGET_LR),
    ({"noise-multiplier": 1.0}, 1.0),
    ({}, 1.0),  # noise multiplier 1 by default
])
def test_a_small_budget_gets_the_smaller_step_and_says_it(budget, lr):
    settings, note = dp_sgd_settings({"dp": "local", **budget})
    assert settings == {**MNIST_DP_SGD, "lr": lr}
    assert f"lr = {lr}" in note, note
    assert SMALL_BUDGET_LR == 0.25  # README and PRIVACY.md: "0.25 under epsilon 2"


def test_resolve_gives_a_small_budget_the_smaller_step():
    assert _trained_with(resolve(None, ["dp=local", "target-epsilon=1"])) == \
        {**MNIST_DP_SGD, "lr": 0.25}


@pytest.mark.parametrize("dataset, model", [("cifar10", "resnet18"), ("fashion-mnist", "mlp"),
                                            ("breast-cancer", "mlp"), ("mnist", "my-plugin")])
def test_without_tuned_settings_a_run_gets_only_the_hint(dataset, model):
    settings, note = dp_sgd_settings({"dp": "local", "dataset": dataset, "model": model,
                                      "target-epsilon": 5})
    assert settings == {}
    assert note is not None and "no tuned settings are known" in note, note
    assert dataset in note and repr(model) in note, note
    # it names the three settings to choose, with what worked on MNIST's small CNN
    assert "batch-size = 64, max-grad-norm = 0.5, lr = 1.0" in note, note


def test_resolve_leaves_an_untuned_model_its_settings_and_prints_the_hint(capsys):
    cfg = resolve(None, ["dp=local", "target-epsilon=5", "model=linear"])
    assert _trained_with(cfg) == PLAIN
    out = capsys.readouterr().out
    assert "no tuned settings are known for mnist with model 'linear'" in out, out
