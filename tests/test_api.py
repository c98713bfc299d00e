"""The Python API (``import fedpriv``): the same code as the CLI, for notebooks."""

from __future__ import annotations

import contextlib
import io

import pytest

import fedpriv

from .test_leakage import observed_run
from .test_strategies import _task_identity  # noqa: F401  (fixture)


def test_load_reads_a_run_folder_back_with_its_ledger_as_a_frame(tmp_path):
    observed_run(tmp_path, {}, rounds=2)  # the ServerApp's loop, in-process
    result = fedpriv.load(tmp_path)
    assert result.ok and [r.round for r in result.ledger] == [1, 2]
    assert result.config.federation.num_clients == 3 and result.epsilon is None
    frame = result.frame()
    assert list(frame["round"]) == [0, 1, 2]  # round 0: the initial model
    assert list(frame["test_accuracy"])[1:] == [r.accuracy for r in result.ledger]
    assert frame["test_accuracy"][0] == result.info["initial"]["accuracy"]
    assert result.accuracy == result.ledger[-1].accuracy
    assert {"test_loss", "trained", "time_round_s", "train_loss", "num_clients"} <= set(
        frame.columns)
    assert all(c == c.lower() and "-" not in c for c in frame.columns)  # snake_case
    assert (frame["trained"][1:] == 3).all() and (frame["num_clients"] == 3).all()
    assert repr(result).startswith("Result(finished, 2 rounds, accuracy ")


def test_run_dir_of_an_existing_run_is_refused_not_replaced(tmp_path):
    # it used to be replaced silently by a new timestamped folder
    old = tmp_path / "old"
    old.mkdir()
    (old / "run.json").write_text('{"status": "finished"}')
    with pytest.raises(fedpriv.ConfigError, match="already holds a run"):
        fedpriv.run(num_clients=3, run_dir=str(old), results_dir=str(tmp_path / "r"))
    assert not (tmp_path / "r").exists() and sorted(p.name for p in old.iterdir()) == [
        "run.json"]


def test_bad_input_raises_one_paragraph_before_anything_starts(tmp_path):
    with pytest.raises(fedpriv.ConfigError, match="num-clientz"):
        fedpriv.run(num_clientz=3, results_dir=str(tmp_path))
    with pytest.raises(fedpriv.ConfigError, match="noise-multiplier"):
        fedpriv.run(dp="local", noise_multiplier=-1.0, results_dir=str(tmp_path))
    with pytest.raises(fedpriv.ConfigError, match="not a fedpriv run folder"):
        fedpriv.load(tmp_path)
    with pytest.raises(fedpriv.ConfigError):
        fedpriv.sweep("no-such-sweep")
    assert list(tmp_path.iterdir()) == []  # nothing was written


@pytest.fixture(scope="module")
def python_sweep(tmp_path_factory):
    """A sweep given from Python (no file): no DP against local DP-SGD, 3 clients, 2 rounds."""
    results = tmp_path_factory.mktemp("api-sweep")
    lines: list[str] = []
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        done = fedpriv.sweep(grid={"dp": ["none", "local"]},
                             fixed={"target_epsilon": 5, "num_clients": 3,
                                    "num_server_rounds": 2},
                             results_dir=str(results), name="notebook", echo=lines.append)
    done.echoed, done.printed = lines, shown.getvalue()
    return done


def test_a_sweep_sends_its_progress_to_echo_and_prints_nothing_itself(python_sweep):
    assert any(x.startswith("sweep notebook: 2 runs") for x in python_sweep.echoed)
    assert any(x.startswith("sweep finished in") for x in python_sweep.echoed)
    assert "sweep finished" not in python_sweep.printed


def test_a_sweep_from_python_is_one_tidy_frame_and_loads_back(python_sweep):
    s = python_sweep
    assert s.ok and s.folder.name.endswith("notebook") and len(s.runs) == 2
    frame = s.frame()
    assert list(frame["cell"]) == [1, 1, 1, 2, 2, 2] and list(frame["round"]) == [0, 1, 2] * 2
    assert list(frame.columns[-2:]) == ["dp", "target_epsilon"]  # settings last
    # target-epsilon acts only in the local-DP cell: no value where it did nothing
    assert frame["target_epsilon"].isna().tolist() == [True] * 3 + [False] * 3
    assert frame["epsilon"].isna().tolist() == [True] * 3 + [False] * 3
    assert frame["epsilon"][3] == 0 and 0 < frame["epsilon"][5] <= 5.0
    assert [c["params"] for c in s.cells] == [{"dp": "none"}, {"dp": "local"}]
    again = fedpriv.load_sweep(s.folder)
    assert again.frame().equals(frame)
    assert [c["params"] for c in again.cells] == [{"dp": "none"}, {"dp": "local"}]
    assert list(again.table().index) == [1, 2]  # sweep.csv, one row per cell
    with pytest.raises(fedpriv.ConfigError, match="not a finished fedpriv sweep folder"):
        fedpriv.load_sweep(s.folder / "plots")
    with pytest.raises(fedpriv.ConfigError, match="not both and not neither"):
        fedpriv.sweep("dp-epsilon-mnist", grid={"dp": ["none"]})


def test_a_result_reads_like_a_notebook_expects(python_sweep):
    plain, private = python_sweep.runs[1], python_sweep.runs[2]
    cfg = private.config
    assert cfg["num-clients"] == cfg["num_clients"] == cfg.num_clients == 3
    assert cfg.dp == "local" and cfg.federation.num_clients == 3  # sections stay
    assert dict(cfg)["target-epsilon"] == 5.0 and "target_epsilon" in cfg
    with pytest.raises(AttributeError, match="Did you mean num-clients"):
        cfg.num_client  # noqa: B018
    with pytest.raises(KeyError):
        cfg["bogus"]
    # equal by content: the same folder read back, not another run
    assert fedpriv.load(private.run_dir) == private and plain != private
    assert set(private.plots) >= {"accuracy", "loss", "epsilon"}
    assert private.plots["accuracy"].is_file()
    page = private._repr_html_()
    assert "<table>" in page and "target-epsilon" in page and page.count(
        "data:image/png;base64,") == len(private.plots)
    delta = private.info["privacy"]["delta-max"]
    assert f"at delta {delta:.3g}" in page  # the claim is epsilon and delta
    assert "width:600px;max-width:100%" in page  # readable, and within the cell
    view = python_sweep._repr_html_()  # a sweep in a notebook: its cells and plots
    assert "2 of 2 finished" in view and "<table" in view and view.count(
        "data:image/png;base64,") == len(list((python_sweep.folder / "plots").glob("*.png")))
    both = fedpriv.concat([plain, private])
    assert len(both) == 6 and list(both["run"].unique()) == [plain.run_dir.name,
                                                            private.run_dir.name]
    assert list(both.columns[-2:]) == ["dp", "target_epsilon"]


def test_help_of_run_lists_every_key():
    import pydoc

    from tasks.config import SCHEMA

    text = pydoc.render_doc(fedpriv.run, renderer=pydoc.plaintext)
    for key in SCHEMA:
        assert f"  {key.name} = " in text, key.name
    assert "keyword arguments, ``_`` for ``-``" in text


def test_the_html_view_sums_up_the_leakage_study():
    from experiments.api import _leakage_headline

    line = _leakage_headline({"observations": 2, "invert": {"psnr": 14.25, "ssim": 0.41},
                              "mia": {"auc": 0.612, "claim-consistent": True},
                              "audit": {"epsilon-lower-bound": 9.1, "claim-consistent": False}})
    assert line == ("invert: psnr 14.2, ssim 0.41; mia: auc 0.612, claim holds; "
                    "audit: epsilon-lower-bound 9.1, CLAIM REJECTED")


def test_attack_from_python_runs_the_leakage_attacks_and_reads_the_run_back(tmp_path):
    """fedpriv.attack: the same attacks as `fedpriv attack`, on an observed run; the run
    comes back with its leakage summary, its HTML view naming it."""
    observed_run(tmp_path, {"leakage-rounds": "1", "observed-examples": 1, "batch-size": 1,
                            "attacks": "labels,invert"})
    lines: list[str] = []
    result = fedpriv.attack(tmp_path, "labels", echo=lines.append)
    assert result.leakage["labels"]["label-accuracy"] == 1.0
    assert "invert" not in result.leakage  # only what was asked
    assert any(x.startswith("attacking 1 observation(s) with labels") for x in lines)
    assert "labels: label-accuracy 1" in result._repr_html_()
    with pytest.raises(fedpriv.ConfigError, match="attacks = 5"):
        fedpriv.attack(tmp_path, 5)


def test_an_echo_that_prints_does_not_loop_back_into_the_sweeps_stream():
    from experiments.api import EchoWriter

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        writer = EchoWriter(lambda line: print("[sweep]", line))  # stdout: `shown`
        with contextlib.redirect_stdout(writer):  # what fedpriv.sweep does around its run
            print("cell 1 finished")
            print("no newline", end="")
        writer.finish()
    assert shown.getvalue() == "[sweep] cell 1 finished\n[sweep] no newline\n"
