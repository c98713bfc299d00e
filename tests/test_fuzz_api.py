"""The Python API as an outside tester drives it: every public entry point with
wrong arguments, damaged folders, and the frames, tables and plots of sweeps whose cells
failed, diverged or got their settings from the sweep's fixed keys. No training: run and
sweep folders are written as the ServerApp writes them, and a sweep's cells are "run" by
a stand-in that writes such folders."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from pathlib import Path

import pytest

import fedpriv
from experiments import api
from experiments.runtime.runner import RunOutcome
from experiments.sweep import run as sweep_run
from experiments.sweep.plots import sweep_plots
from experiments.sweep.replot import _read_sweep
from tasks.config import ConfigError, to_toml, validate
from tasks.files import WriteFailed, temporary
from tasks.results.ledger import RoundRecord

FULL = "/dev/full"  # every write to it fails with ENOSPC, as on a full disk (test_resume)


# --- run and sweep folders, written as the ServerApp and a sweep write them -----------

def _privacy(cfg, rnd: int) -> dict | None:
    if cfg.privacy.dp == "local":
        eps = (cfg.privacy.target_epsilon or 3.0) * rnd / cfg.federation.num_server_rounds
        return {"mode": "local", "epsilon-max": eps, "epsilon-mean": eps, "delta": 1e-5}
    if cfg.privacy.dp == "central":
        return {"mode": "central", "epsilon": 2.0 * rnd, "delta": 1e-5}
    return None


def write_run(folder: Path, values: dict | None = None, *, accuracy: float = 0.9,
              status: str = "finished", diverged: int | None = None, rounds: int | None = None,
              anonymization: dict | None = None) -> dict:
    """A run folder as a run leaves it (config.toml, metrics.jsonl, run.json); the
    run.json entries as a dict. ``diverged``: the round from which its model is broken."""
    cfg = values if hasattr(values, "flat") else validate({"num-server-rounds": 3,
                                                           **(values or {})})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(to_toml(cfg))
    n = cfg.federation.num_server_rounds if rounds is None else rounds
    ledger = []
    for rnd in range(1, n + 1):
        broken = diverged is not None and rnd >= diverged
        acc = 0.1 if broken else accuracy * rnd / n
        ledger.append(RoundRecord(rnd, {"accuracy": acc, "loss": math.nan if broken else 0.5},
                                  {}, [0, 1], [], [], {"round-s": 1.0},
                                  privacy=_privacy(cfg, rnd)))
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps(r.to_json()) + "\n" for r in ledger))
    info = {"status": status, "initial": {"accuracy": 0.1, "loss": 2.3},
            "rounds-completed": n}
    if ledger and ledger[-1].privacy:
        info["privacy"] = ledger[-1].privacy
    if diverged is not None:
        info["diverged"] = {"round": diverged, "cause": "the test loss is nan"}
    if anonymization:
        info["anonymization"] = anonymization
    if status != "finished":
        info["error"] = "RuntimeError: every client failed"
    (folder / "run.json").write_text(json.dumps(info))
    return info


@pytest.fixture
def no_work(monkeypatch, tmp_path):
    """Every way a call could start work raises: a pre-flight check, the in-process
    runtime's child, a new results folder. Runs in an empty folder, which must stay so."""
    def started(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    class NoLink:
        def __init__(self, *args, **kwargs):
            started()

    for module in (api, sweep_run):
        for name in ("preflight_isolated", "new_run_dir"):
            monkeypatch.setattr(module, name, started)
    monkeypatch.setattr(sweep_run, "preflight_many", started)
    monkeypatch.setattr(api, "InProcessLink", NoLink)
    monkeypatch.setattr(sweep_run, "InProcessLink", NoLink)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield cwd
    assert list(cwd.iterdir()) == [], "a bad argument left files behind"


@pytest.fixture
def a_run(tmp_path) -> fedpriv.Result:
    write_run(tmp_path / "runs" / "plain")
    return fedpriv.load(tmp_path / "runs" / "plain")


# --- 1. wrong arguments: one paragraph, before any work --------------------------------

NAN = float("nan")
NOWHERE = Path("/nonexistent/fedpriv-nothing-here")
WRONG = {"None": None, "int": 1, "str": "x", "list": [1], "dict": {"a": 1}, "bytes": b"x",
         "nan": NAN, "path": NOWHERE}

# entry point -> (the valid call it varies, {parameter: (values it accepts, what the
# error must name)}); a parameter is varied over every WRONG value it does not accept
RES = "results-of-a-bad-call"
ENTRIES = {
    "run": ({"echo": None, "results_dir": RES}, {
        "preset": ({"None"}, r"preset"),
        "name": ({"None", "str"}, r"\bname\b"),
        "supernodes": (set(), r"supernodes"),
        "verbose": (set(), r"verbose"),
        "echo": ({"None"}, r"echo"),
        "num_clients": ({"int"}, r"num-clients"),
        "results_dir": ({"str", "path"}, r"results-dir"),
    }),
    "run_config": ({"echo": None}, {
        "cfg": (set(), r"cfg"),
        "name": ({"None", "str"}, r"\bname\b"),
        "supernodes": (set(), r"supernodes"),
        "verbose": (set(), r"verbose"),
        "echo": ({"None"}, r"echo"),
    }),
    "sweep": ({"grid": {"dp": ["none", "local"]}, "results_dir": RES}, {
        "file": (set(), r"file|sweep .* not found|not both"),
        "grid": (set(), r"grid"),
        "fixed": ({"None"}, r"fixed"),
        "cells": ({"None"}, r"cells"),
        "preset": ({"None"}, r"preset"),
        "name": ({"str"}, r"\bname\b"),
        "dry_run": (set(), r"dry_run"),
        "verbose": (set(), r"verbose"),
        "repeat": ({"None", "int"}, r"repeat"),
        "separate": (set(), r"separate"),
        "num_clients": ({"int"}, r"num-clients"),
    }),
    "load": ({}, {"run_dir": (set(), r"run_dir|not a fedpriv run folder")}),
    "resume": ({"run_dir": "nowhere"}, {
        "run_dir": (set(), r"run_dir|not a fedpriv run folder"),
        "verbose": (set(), r"verbose"),
        "echo": ({"None"}, r"echo"),
    }),
    "load_sweep": ({}, {"folder": (set(), r"folder|not a finished fedpriv sweep folder")}),
    "concat": ({}, {"results": (set(), r"results")}),
    "Result.frame": ({}, {"config": (set(), r"config|unknown")}),
}
CASES = [pytest.param(entry, param, kind, match, id=f"{entry}-{param}-{kind}")
         for entry, (_, params) in ENTRIES.items()
         for param, (accepted, match) in params.items()
         for kind in WRONG if kind not in accepted]


def _call(entry: str, param: str, value, result: fedpriv.Result):
    base, _ = ENTRIES[entry]
    kwargs = {**base, param: value}
    if entry == "sweep" and param == "file":
        kwargs.pop("grid")
    if entry == "run_config":
        kwargs.setdefault("cfg", validate({}))
    if entry == "Result.frame":
        return result.frame(**kwargs)
    return getattr(fedpriv, entry)(**kwargs)


@pytest.mark.parametrize("entry, param, kind, match", CASES)
def test_every_entry_point_refuses_a_wrong_argument_in_one_paragraph_before_any_work(
        entry, param, kind, match, no_work, a_run):
    with pytest.raises((ConfigError, TypeError)) as caught:
        _call(entry, param, WRONG[kind], a_run)
    message = str(caught.value)
    assert caught.type in (ConfigError, TypeError), caught.type  # not a subclass's surprise
    assert re.search(match, message), message
    assert "\n\n" not in message and len(message) < 1500, message  # one paragraph
    assert "Traceback" not in message


def test_the_outside_testers_cases_name_the_argument_what_it_takes_and_how(no_work, a_run):
    cases = [
        (lambda: fedpriv.run(123), "preset = 123 (type int)", "'mnist'"),
        (lambda: fedpriv.run(["mnist"]), "preset = ['mnist'] (type list)", "TOML file"),
        (lambda: fedpriv.run(echo="yes"), "echo = 'yes'", "echo=None"),
        (lambda: fedpriv.run(name=5), "name = 5 (type int)", "name='baseline'"),
        (lambda: fedpriv.sweep(grid={"num_clients": 3}), "grid['num-clients'] = 3",
         "non-empty list"),
        (lambda: fedpriv.sweep(grid=[("a", 1)]), "grid = [('a', 1)] (type list)",
         "mapping of run-config keys to lists"),
        (lambda: fedpriv.sweep(cells=[5]), "cells[0] = 5 (type int)", "mapping"),
        (lambda: fedpriv.load(None), "run_dir = None", "pathlib.Path"),
        (lambda: fedpriv.load(123), "run_dir = 123 (type int)", "fedpriv.load('results/"),
        (lambda: fedpriv.resume(123), "run_dir = 123 (type int)", "fedpriv.resume('results/"),
        (lambda: fedpriv.resume(a_run.run_dir, echo=5), "echo = 5 (type int)", "echo=None"),
        (lambda: a_run.frame(config=5), "config = 5 (type int)", "'changed'"),
        (lambda: fedpriv.concat([]), "results is empty", "fedpriv.concat([fedpriv.load("),
        (lambda: fedpriv.concat([1, 2]), "results[0] = 1 (type int)", "a Result"),
        (lambda: fedpriv.run(supernodes="yes"), "supernodes = 'yes' (type str)", "True or False"),
    ]
    for call, given, fix in cases:
        with pytest.raises(ConfigError) as caught:
            call()
        message = str(caught.value)
        assert message.startswith("fedpriv.") and "\n" not in message, message
        assert given in message and fix in message, message


def test_a_key_given_twice_in_two_spellings_is_refused_not_the_last_one_run(no_work):
    # it used to run 4 clients: the dashed spelling silently won
    with pytest.raises(ConfigError, match=r"num-clients is given twice .*'num_clients' = 3 "
                                          r"and 'num-clients' = 4"):
        fedpriv.run(num_clients=3, **{"num-clients": 4})
    with pytest.raises(ConfigError, match="num-clients is given twice in fixed"):
        fedpriv.sweep(grid={"dp": ["none"]}, fixed={"num_clients": 3, "num-clients": 4})
    with pytest.raises(ConfigError, match="num-clients is given twice in grid"):
        fedpriv.sweep(grid={"num_clients": [3], "num-clients": [4]})
    with pytest.raises(ConfigError, match=r"local-epochs is given twice in cells\[0\]"):
        fedpriv.sweep(cells=[{"local_epochs": 1, "local-epochs": 2}])
    with pytest.raises(ConfigError, match="num-clients is given twice in keyword arguments"):
        fedpriv.sweep(grid={"dp": ["none"]}, num_clients=3, **{"num-clients": 4})


# --- 2. damaged folders name the file --------------------------------------------------

def test_a_damaged_run_json_is_named_when_loaded_and_when_read(tmp_path):
    folder = tmp_path / "run"
    info = write_run(folder, {"dp": "local", "target-epsilon": 5})
    for privacy, what in (("high", r"its 'privacy' is 'high' \(type str\)"),
                          ({"mode": "local", "epsilon-max": "5"},
                           r"its privacy epsilon is '5' \(type str\), not a number")):
        (folder / "run.json").write_text(json.dumps({**info, "privacy": privacy}))
        with pytest.raises(ConfigError, match=f"{re.escape(str(folder / 'run.json'))} is "
                                              f"damaged: {what}"):
            fedpriv.load(folder)
    # a Result made by hand (or changed after loading): .epsilon names the file too
    result = fedpriv.Result(folder, validate({}), [], {"privacy": "high"})
    with pytest.raises(ConfigError, match=re.escape(str(folder / "run.json"))):
        result.epsilon  # noqa: B018


def test_a_finished_run_whose_ledger_is_empty_is_refused_naming_the_file(tmp_path):
    folder = tmp_path / "run"
    write_run(folder)
    (folder / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match=re.escape(str(folder / "metrics.jsonl"))
                       + r" is empty, yet run.json says the run finished 3 round\(s\)"):
        fedpriv.load(folder)
    (folder / "metrics.jsonl").unlink()
    with pytest.raises(ConfigError, match="metrics.jsonl is missing, yet run.json says"):
        fedpriv.load(folder)
    # no round to read is right for a run that stopped before its first round, or crashed
    for info in ({"status": "finished", "stopped-early": "the budget is spent",
                  "rounds-completed": 0}, {"status": "crashed"}):
        (folder / "run.json").write_text(json.dumps(info))
        assert fedpriv.load(folder).ledger == []


@pytest.fixture
def fake_runs(monkeypatch):
    """A sweep's cells "run" by writing their folders (``write_run``) and recorded as the
    sweep records a run: ``plan[index]`` gives a cell's outcome (status, diverged,
    accuracy); ``plan["full"]``: a file of the sweep's own that lies on a full disk."""
    plan: dict = {}

    def run_together(runtimes, out, spec, cells, verbose, at_once=None):
        if "full" in plan:
            os.symlink(FULL, temporary(out / plan["full"]))
        for c in cells:
            c.run_dir = out / "cells" / c.folder
            info = write_run(c.run_dir, c.config, **plan.get(c.index, {}))
            sweep_run._record(c, RunOutcome(c.run_dir, info["status"], info.get("error"),
                                            info, 1.0))
            sweep_run.write_table(out, spec, cells)

    monkeypatch.setattr(sweep_run, "_run_together", run_together)
    return plan


def _sweep(tmp_path, **kwargs) -> fedpriv.SweepResult:
    return fedpriv.sweep(**kwargs, results_dir=str(tmp_path / "results"), name="t")


def _write_csv(path: Path, rows: list[list[str]]) -> None:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def test_load_sweep_refuses_a_damaged_sweep_csv_naming_it(tmp_path, fake_runs):
    out = _sweep(tmp_path, grid={"dp": ["none", "local"]}).folder
    table = out / "sweep.csv"
    head, *rows = list(csv.reader(table.open(newline="")))
    assert fedpriv.load_sweep(out).runs.keys() == {1, 2}
    at = {k: i for i, k in enumerate(head)}

    def changed(row: int, key: str, value: str) -> list[list[str]]:
        out_rows = [list(r) for r in rows]
        out_rows[row][at[key]] = value
        return [head, *out_rows]

    cases = [
        ([], "is empty"),
        ([head], r"lists no cells \(only its header\)"),
        ([[k for k in head if k != "cell"], *[r[1:] for r in rows]], "has no cell column"),
        (changed(0, "cell", "one"), "line 2: cell 'one' is not a whole number"),
        (changed(1, "cell", "1"), "line 3: cell 1 is listed twice"),
        (changed(0, "run-dir", "../../etc"), "line 2: cell 1's run-dir '../../etc' lies "
                                             "outside the sweep's folder"),
        (changed(0, "run-dir", "/etc"), "line 2: cell 1's run-dir '/etc' lies outside"),
        (changed(1, "run-dir", "cells/../.."), "line 3: cell 2's run-dir 'cells/../..' lies "
                                               "outside"),
        ([head, rows[0][:3]], "line 2 has 3 fields where its header has"),
    ]
    for content, why in cases:
        _write_csv(table, content)
        with pytest.raises(ConfigError, match=re.escape(str(table)) + " " + why):
            fedpriv.load_sweep(out)
    _write_csv(table, [head, *rows])
    result = fedpriv.load_sweep(out)
    _write_csv(table, [head])  # damaged after loading: .table() names it too
    with pytest.raises(ConfigError, match=re.escape(str(table)) + " lists no cells"):
        result.table()


# --- 3. keys a run never reads are empty, default values included ----------------------

def test_keys_a_run_never_reads_are_empty_in_every_frame_and_table(tmp_path, fake_runs):
    write_run(tmp_path / "plain")
    write_run(tmp_path / "private", {"dp": "local", "target-epsilon": 5})
    plain, private = fedpriv.load(tmp_path / "plain"), fedpriv.load(tmp_path / "private")
    both = fedpriv.concat([plain, private])
    # target-epsilon (0, its default, in the plain run) read as "perfect privacy"
    assert both.groupby("run")["target_epsilon"].first().isna().to_dict() == {
        "plain": True, "private": False}
    frame = plain.frame(config=["target_epsilon", "noise_multiplier", "max_grad_norm", "lr"])
    assert frame[["target_epsilon", "noise_multiplier", "max_grad_norm"]].isna().all().all()
    assert (frame["lr"] == plain.config.lr).all()
    assert plain.frame(config="all")["clipping_norm"].isna().all()
    assert private.frame(config="all")["max_grad_norm"].notna().all()

    s = _sweep(tmp_path, cells=[{"dp": "none"}, {"dp": "local", "target_epsilon": 5}])
    for sweep in (s, fedpriv.load_sweep(s.folder)):
        by_cell = sweep.frame().groupby("cell")["target_epsilon"].first()
        assert by_cell.isna().to_dict() == {1: True, 2: False}
        assert sweep.table()["target-epsilon"].isna().tolist() == [True, False]


# --- 4. each cell's effective settings in every table ----------------------------------

def test_a_key_a_cell_got_from_the_fixed_keys_is_in_the_table(tmp_path, fake_runs):
    # dp-central-noise's shape: the grid's cells get dp from [fixed], the baseline sets it
    s = _sweep(tmp_path, grid={"noise_multiplier": [0.5, 1.0]}, fixed={"dp": "central"},
               cells=[{"dp": "none"}])
    table = s.table()
    assert table["dp"].tolist() == ["central", "central", "none"]  # blank before
    assert table.groupby("dp").size().to_dict() == {"central": 2, "none": 1}
    assert table["noise-multiplier"].isna().tolist() == [False, False, True]  # reads none
    params = [{"noise-multiplier": 0.5, "dp": "central"},
              {"noise-multiplier": 1.0, "dp": "central"}, {"dp": "none"}]
    assert [c["params"] for c in s.cells] == params
    assert [c["params"] for c in fedpriv.load_sweep(s.folder).cells] == params
    # the plots keep each cell's own label, redrawn from the folder as well
    spec, cells = _read_sweep(s.folder)
    assert [c.label for c in cells] == ["noise-multiplier=0.5", "noise-multiplier=1.0",
                                        "dp=none"]


# --- 5. a failed or diverged cell is never a baseline nor on a front -------------------

def _labels(fig) -> list[str]:
    (ax,) = fig.axes
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def _check_privacy_plots(figs) -> None:
    (ax,) = figs["privacy_accuracy.png"].axes
    labels = _labels(figs["privacy_accuracy.png"])
    assert "no DP (dp=none) (diverged at round 2; not drawn)" in labels, labels
    for line in ax.lines:  # the diverged no-DP cell is not drawn at all
        if line.get_label().startswith("no DP"):
            assert len(line.get_xdata()) == 0, line.get_label()
    (trade,) = [x for x in ax.lines if x.get_label() == "with DP (epsilon spent)"]
    assert list(trade.get_xdata()) == [5.0]  # the failed eps=1 cell is not on the line
    (failed,) = [x for x in ax.lines if x.get_label() == "DP (target-epsilon=1) (failed)"]
    assert list(failed.get_xdata()) == [1.0] and failed.get_marker() == "x"
    assert "target-epsilon=1 (failed)" in _labels(figs["epsilon_vs_round.png"])
    assert {"dp=none (diverged at round 2)", "target-epsilon=1 (failed)",
            "target-epsilon=5"} <= set(_labels(figs["accuracy_vs_round.png"]))
    (bars,) = figs["final_accuracy.png"].axes
    ticks = [t.get_text() for t in bars.get_yticklabels()]
    assert ticks == ["target-epsilon=1 (failed)", "target-epsilon=5",
                     "dp=none (diverged at round 2)"]
    assert [p.get_facecolor()[:3] for p in bars.patches].count(
        bars.patches[1].get_facecolor()[:3]) == 1  # only the sound cell is blue
    assert "1 cell(s) did not finish, 1 cell(s) diverged" in bars.get_xlabel()


def test_a_diverged_no_dp_cell_is_no_baseline_and_every_plot_says_so(tmp_path, fake_runs,
                                                                      monkeypatch):
    import experiments.sweep.plots as plots

    drawn = {}
    monkeypatch.setattr(plots, "sweep_plots",
                        lambda *a: drawn.update(sweep_plots(*a)) or drawn)
    fake_runs.update({1: {"status": "failed", "accuracy": 0.5},
                      3: {"diverged": 2, "accuracy": 0.95}})
    s = _sweep(tmp_path, grid={"target_epsilon": [1, 5]}, fixed={"dp": "local"},
               cells=[{"dp": "none"}])
    assert [c["status"] for c in s.cells] == ["failed", "finished", "finished"]
    assert s.runs[3].diverged == {"round": 2, "cause": "the test loss is nan"}
    _check_privacy_plots(drawn)  # as the sweep drew them
    spec, cells = _read_sweep(s.folder)  # and as --replot draws them from the folder
    _check_privacy_plots(sweep_plots(tmp_path / "replot", spec["name"], cells))


def test_a_diverged_cell_is_not_on_the_pareto_front_nor_in_a_seeds_mean(tmp_path):
    from experiments.sweep.spec import Cell

    def anonymized(index, reid, acc, diverged=None):
        return Cell(index, {"k": index}, None, "finished", result={
            "final": {"accuracy": acc}, "diverged": diverged,
            "anonymization": {"anonymizer": "ksame",
                              "mean": {"reid-top1": reid, "mia-auc": reid}}})

    cells = [anonymized(1, 0.01, 0.95, {"round": 4, "cause": "nan"}),  # would beat all
             anonymized(2, 0.1, 0.8), anonymized(3, 0.5, 0.9)]
    figs = sweep_plots(tmp_path / "a", "s", cells)
    for name in ("reid_accuracy.png", "mia_accuracy.png"):
        (ax,) = figs[name].axes
        (front,) = [x for x in ax.lines if x.get_label() == "Pareto front"]
        assert list(front.get_xdata()) == [0.1, 0.5], name
        assert "k=1 (diverged at round 4; not on the front)" in _labels(figs[name])

    runs = []
    for seed, diverged in ((1, None), (2, 2)):
        cell = Cell(seed, {"lr": 0.1}, None, "finished", seed=seed,
                    run_dir=tmp_path / f"seed{seed}")
        info = write_run(cell.run_dir, accuracy=0.9 if diverged is None else 0.2,
                         diverged=diverged)
        cell.result = {"final": {"accuracy": 0.9 if diverged is None else 0.1},
                       "diverged": info.get("diverged")}
        runs.append(cell)
    figs = sweep_plots(tmp_path / "b", "s", runs)
    (ax,) = figs["accuracy_vs_round.png"].axes
    (line,) = ax.lines
    assert line.get_label() == "lr=0.1 (n=1; seed=2 diverged at round 2)"
    # seed 1's alone, from round 0 (the model it started from)
    assert list(line.get_ydata()) == pytest.approx([0.1, 0.3, 0.6, 0.9])
    (bars,) = figs["final_accuracy.png"].axes
    assert bars.patches[0].get_width() == pytest.approx(0.9)


# --- 6. a full disk ends a sweep with one paragraph, its finished cells kept -----------

@pytest.mark.skipif(not os.path.exists(FULL), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("full", ["plots/accuracy_vs_round.png", "sweep.csv"])
def test_a_full_disk_ends_a_sweep_with_its_cause_and_keeps_the_finished_cells(
        tmp_path, fake_runs, capsys, full):
    fake_runs["full"] = full
    with pytest.raises(WriteFailed) as caught:
        _sweep(tmp_path, grid={"dp": ["none", "local"]})
    (out,) = (tmp_path / "results" / "sweeps").iterdir()
    message = str(caught.value)
    assert message.startswith(f"cannot write {out / full}: No space left on device (the "
                              "disk is full: free some space); every finished cell's run "
                              f"folder is kept under {out / 'cells'}"), message
    assert "\n" not in message and f"fedpriv sweep --replot {out}" in message
    kept = sorted(p.name for p in (out / "cells").iterdir())
    assert kept == (["01-dp-none", "02-dp-local"] if full.startswith("plots") else
                    ["01-dp-none"])  # sweep.csv fails as the first cell is recorded
    assert fedpriv.load(out / "cells" / "01-dp-none").ok
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]  # no half-written file
    if full.startswith("plots"):
        assert [c["status"] for c in fedpriv.load_sweep(out).cells] == ["finished"] * 2
    assert f"fedpriv: error: {message}" in capsys.readouterr().err
    # the CLI's path: the same paragraph, exit status 1, no traceback
    done = sweep_run.run_sweep({"grid": {"dp": ["none"]}},
                               values={"results-dir": str(tmp_path / "cli")})
    assert done.exit_code == 1 and "the disk is full" in str(done.error)


@pytest.mark.skipif(not os.path.exists(FULL), reason="needs Linux's /dev/full")
def test_replot_on_a_full_disk_says_so_in_one_paragraph(tmp_path, fake_runs, capsys):
    from experiments.cli.main import main

    out = _sweep(tmp_path, grid={"dp": ["none", "local"]}).folder
    capsys.readouterr()
    os.symlink(FULL, temporary(out / "plots" / "accuracy_vs_round.png"))
    assert main(["sweep", "--replot", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fedpriv: error: cannot write ") and "the disk is full" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err
