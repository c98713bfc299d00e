"""Experiment tracking (run-config key ``tracking``): real small runs (the ServerApp's code and
the real ClientApp, in-process, 3 clients, 2 rounds) logged to TensorBoard and MLflow, read
back with the libraries' own readers and compared with the ledger."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
from flwr.app import Context, RecordDict
from PIL import Image

from experiments.configs import check_registered
from server.federation import run_federation
from server.tracking import (
    BACKENDS,
    RUN_ID_TAG,
    Tracking,
    param_text,
    plot_files,
    require,
    round_numbers,
    tracking_uri,
)
from tasks.config import KEYS, ConfigError, validate
from tasks.results.folder import RunFolder, read_run_info
from tasks.results.ledger import read_ledger

from .conftest import REPO
from .inprocess import InProcessGrid
from .test_strategies import _task_identity  # noqa: F401  (fixture)

SMALL = {"num-clients": 3, "num-server-rounds": 2, "save-model": False, "run-id": "t-1"}


def _run(tmp_path, **values):
    """A whole run as the ServerApp does it (run_federation: hooks, plots, run.json)."""
    cfg = validate({**SMALL, "results-dir": str(tmp_path / "results"), **values})
    run = RunFolder(tmp_path / "results" / "small-run")
    run.write_config(cfg)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=cfg.flat())
    run_federation(InProcessGrid(cfg, simulated=True), context, cfg, run)
    return cfg, run.path


def test_every_tracking_value_has_a_tracker():
    assert set(KEYS["tracking"].choices) == {"none", *BACKENDS}


def test_a_round_logs_every_number_of_its_ledger_record(tmp_path):
    from tasks.results.ledger import RoundRecord

    record = RoundRecord(round=3, test={"loss": 0.5, "accuracy": 0.8}, train={
        "loss": 0.4, "num-examples": 10, "clients": 2}, sampled=[0, 1], clients=[{"x": 1}],
        failures=[], time={"round-s": 1.5}, privacy={"mode": "local", "epsilon-max": 2.0,
                                                      "epsilon": {"0": 1.0, "1": 2.0},
                                                      "skipped": []})
    assert round_numbers(record) == {
        "test/loss": 0.5, "test/accuracy": 0.8, "train/loss": 0.4, "train/num-examples": 10.0,
        "train/clients": 2.0, "time/round-s": 1.5, "privacy/epsilon-max": 2.0,
        "privacy/epsilon/0": 1.0, "privacy/epsilon/1": 2.0}


def _expected(run_dir):
    """Step -> tag -> value, from the ledger (and run.json's initial test for step 0)."""
    want = {r.round: round_numbers(r) for r in read_ledger(run_dir)}
    want[0] = {f"test/{k}": v for k, v in read_run_info(run_dir)["initial"].items()}
    return want


def test_tensorboard_gets_the_ledger_the_config_and_the_plots(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
    from tensorboard.util.tensor_util import make_ndarray

    cfg, run_dir = _run(tmp_path, tracking="tensorboard")
    assert read_run_info(run_dir)["status"] == "finished"
    ea = EventAccumulator(str(run_dir / "tensorboard"),
                          size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    ea.Reload()
    want = _expected(run_dir)
    assert [r.round for r in read_ledger(run_dir)] == [1, 2]
    tags = {tag for step in want.values() for tag in step}
    assert {"test/accuracy", "test/loss", "train/loss", "time/round-s"} <= tags
    for tag in tags:
        got = {e.step: float(make_ndarray(e.tensor_proto)) for e in ea.Tensors(tag)}
        assert got == {s: v[tag] for s, v in want.items() if tag in v}, tag  # exact: float64
    # the config, as hyperparameters
    content = ea.PluginTagToContent("hparams")
    start = next(HParamsPluginData.FromString(v).session_start_info for v in content.values()
                 if HParamsPluginData.FromString(v).HasField("session_start_info"))
    assert start.hparams["num-clients"].number_value == 3
    assert start.hparams["tracking"].string_value == "tensorboard"
    assert set(start.hparams) == set(cfg.flat())
    # the plots, as images of their size
    plots = dict((tag, path) for path, tag in plot_files(run_dir))
    assert {"plots/accuracy", "plots/loss"} <= set(plots)
    assert set(ea.Tags()["images"]) == set(plots)
    for tag, path in plots.items():
        (event,) = ea.Images(tag)
        with Image.open(path) as img:
            assert (event.width, event.height) == img.size and event.step == 2


def test_mlflow_gets_the_ledger_the_config_and_the_plots(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg, run_dir = _run(tmp_path, tracking="mlflow", **{"tracking-experiment": "study-a"})
    client = MlflowClient(tracking_uri=tracking_uri(tmp_path / "results"))
    experiment = client.get_experiment_by_name("study-a")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "small-run" and run.info.status == "FINISHED"
    assert run.data.tags[RUN_ID_TAG] == "t-1"
    want = _expected(run_dir)
    tags = {tag for step in want.values() for tag in step}
    assert set(run.data.metrics) == tags
    for tag in tags:
        history = client.get_metric_history(run.info.run_id, tag)
        assert {m.step: m.value for m in history} == {
            s: v[tag] for s, v in want.items() if tag in v}, tag
    assert run.data.params == {k: param_text(v) for k, v in cfg.flat().items()}
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {f"{tag}.png" for _, tag in plot_files(run_dir)} == arts
    local = client.download_artifacts(run.info.run_id, "plots/accuracy.png",
                                      str(tmp_path / "down"))
    assert open(local, "rb").read() == (run_dir / "plots" / "accuracy.png").read_bytes()


def test_an_unknown_tracker_is_refused_with_the_allowed_values():
    with pytest.raises(ConfigError, match=r"tracking = 'wandb' must be one of none, "
                                          r"tensorboard, mlflow"):
        validate({"tracking": "wandb"})


def test_a_tracker_whose_library_is_missing_is_refused_before_any_work(monkeypatch):
    cfg = validate({"tracking": "mlflow"})
    check_registered(cfg)  # installed here: no error
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    with pytest.raises(ConfigError) as refused:
        check_registered(cfg)  # what the CLI and the Python API ask before anything starts
    text = str(refused.value)
    assert text.startswith("tracking = 'mlflow' needs the Python package 'mlflow', which is "
                           "not installed") and "\n" not in text
    assert f"pip install -e '{REPO}[tracking]'" in text
    assert "none | tensorboard | mlflow" in text
    require(validate({"tracking": "none"}))
    require(validate({"tracking": "tensorboard"}))


def test_a_tracker_that_fails_mid_run_warns_once_and_the_run_goes_on(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = validate({**SMALL, "results-dir": str(tmp_path), "tracking": "tensorboard"})
    run_dir = tmp_path / "run"
    (run_dir / "plots").mkdir(parents=True)
    for name in ("a.png", "b.png"):
        (run_dir / "plots" / name).write_bytes(b"not a png")  # a plot cut short
    Image.new("RGB", (40, 30), "red").save(run_dir / "plots" / "c.png")
    hook = Tracking(cfg, run_dir)
    hook.finish()  # two plots fail to log: one warning, and the third is still logged
    out = capsys.readouterr().out
    assert out.count("warning: tracking (tensorboard) failed") == 1, out
    assert "while logging the plot plots/a: UnidentifiedImageError" in out
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    ea.Reload()
    assert ea.Tags()["images"] == ["plots/c"]
    assert (ea.Images("plots/c")[0].width, ea.Images("plots/c")[0].height) == (40, 30)


@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow"])
def test_a_crashed_then_resumed_run_is_one_tracked_run_with_every_round_once(tmp_path,
                                                                               tracker):
    from server.app import run_one
    from server.checkpoint import Checkpoint, resumable

    from .test_resume import LostReplies

    results = tmp_path / "results"
    cfg = validate({**SMALL, "num-server-rounds": 3, "tracking": tracker,
                    "results-dir": str(results), "run-dir": str(results / "crashed")})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=cfg.flat())
    with pytest.raises(ConnectionError):  # round 2's replies are lost
        run_one(LostReplies(cfg, 2), context, cfg)
    folder, again = resumable(results / "crashed")
    RunFolder(folder).reopen({"from-round": Checkpoint.load(folder).round})
    if tracker == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri(results))
        (crashed,) = client.search_runs([client.get_experiment_by_name("fedpriv")
                                         .experiment_id])
        assert crashed.info.status == "FAILED"
    run_one(InProcessGrid(again, simulated=True), context, again)
    assert [r.round for r in read_ledger(folder)] == [1, 2, 3]
    want = _expected(folder)
    if tracker == "mlflow":
        (run,) = client.search_runs([crashed.info.experiment_id])
        assert run.info.run_id == crashed.info.run_id and run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "test/accuracy")
        assert sorted((m.step, m.value) for m in history) == sorted(
            (s, v["test/accuracy"]) for s, v in want.items())
        assert run.data.params["resume"] == "false"  # the config it started with
    else:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from tensorboard.util.tensor_util import make_ndarray

        ea = EventAccumulator(str(folder / "tensorboard"), size_guidance={"tensors": 0})
        ea.Reload()
        got = [(e.step, float(make_ndarray(e.tensor_proto)))
               for e in ea.Tensors("test/accuracy")]
        assert got == sorted((s, v["test/accuracy"]) for s, v in want.items())


@pytest.mark.slow
def test_the_ray_runtime_tracks_through_the_same_serverapp(tmp_path):
    """``runtime = "ray"``: the ServerApp runs in Flower's simulation process; the same hook
    logs to the same store."""
    from mlflow.tracking import MlflowClient

    from .conftest import run_cli

    results = tmp_path / "results"
    res = run_cli("run", "--set", "runtime=ray", "--set", "num-clients=3", "--set",
                  "num-server-rounds=2", "--set", "tracking=mlflow", "--set",
                  f"results-dir={results}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    (run_dir,) = [p for p in results.iterdir() if (p / "run.json").is_file()]
    assert read_run_info(run_dir)["runtime"] == "ray"
    client = MlflowClient(tracking_uri=tracking_uri(results))
    (run,) = client.search_runs([client.get_experiment_by_name("fedpriv").experiment_id])
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    want = _expected(run_dir)
    history = client.get_metric_history(run.info.run_id, "test/loss")
    assert {m.step: m.value for m in history} == {s: v["test/loss"] for s, v in want.items()}
    assert run.data.params["runtime"] == "ray"
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {f"{tag}.png" for _, tag in plot_files(run_dir)} == arts


def test_what_the_cli_adds_after_the_serverapp_goes_to_the_same_tracked_run(tmp_path):
    """The partitioner's label plot and the leakage attacks come after the ServerApp
    (experiments.runtime.runner.after_run, in the CLI): logged to the same MLflow run."""
    from mlflow.tracking import MlflowClient

    from experiments.runtime.runner import after_run
    from server.tracking import numbers

    cfg, run_dir = _run(tmp_path, tracking="mlflow", **{
        "leakage-rounds": "2", "observed-examples": 2, "attacks": "labels"})
    assert not (run_dir / "plots" / "label_distribution.png").exists()  # not disclosed
    lines: list[str] = []
    cli = replace(cfg, results=replace(cfg.results, run_id=""))  # the CLI's, before the id
    after_run(cli, run_dir, "finished", None, 1.0, lines.append,
              label_counts=[[10] * 10, [20] * 10, [30] * 10])
    leakage = numbers(read_run_info(run_dir)["leakage"], "leakage/")
    assert "leakage/labels/label-accuracy" in leakage, lines
    client = MlflowClient(tracking_uri=tracking_uri(tmp_path / "results"))
    (run,) = client.search_runs([client.get_experiment_by_name("fedpriv").experiment_id])
    assert run.info.status == "FINISHED"
    for tag, value in leakage.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag)
                ] == [(2, value)], tag
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/label_distribution.png", "plots/accuracy.png"} <= arts
    assert len(client.get_metric_history(run.info.run_id, "test/accuracy")) == 3  # 0, 1, 2
