"""A seeded fuzz of the newest run-config keys and what the outside tester found accepted,
through the real CLI entry point (``experiments.cli.main``), in-process: ``runtime``,
``train-together``, ``server = "malicious"``, ``he-min-cohort``, ``canaries``,
``tracking``, ``plugins`` at their edge values and in combination; keys without effect;
plugins that fail; sweep-cells, ray-address and tracking stores that cannot work; paths
with spaces, non-ASCII characters and newlines. Each bad input must end in exit code 2 with
one paragraph per problem naming the key, before any work: no traceback, no run folder,
no SuperLink, Ray process or training (a guard raises where the run would start).

Plugins register names for the whole process, so the plugin cases run the CLI in a child
process (:data:`DRIVER`), as tests/test_examples.py does.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import experiments.api
from experiments.cli import main as cli
from experiments.runtime.choice import choose
from tasks.config import KEYS, ConfigError, parse_assignment, validate
from tasks.config.keys import INT_MAX

from .conftest import REPO

SEED = 20261128


class Reached(Exception):
    """The input got through every check to where work would start."""


@pytest.fixture
def accepted(monkeypatch):
    """Guard ``run_config``: the configs that reach it are recorded, nothing runs."""
    seen: list = []

    def reached(cfg, **kwargs):
        seen.append((cfg, kwargs))
        raise Reached

    monkeypatch.setattr(experiments.api, "run_config", reached)
    monkeypatch.setattr(experiments.api, "resume", reached)
    saved = signal.getsignal(signal.SIGTERM)
    yield seen
    signal.signal(signal.SIGTERM, saved)


@pytest.fixture
def launched(monkeypatch):
    """Guard ``_launch`` (where the SuperLink, Ray or the in-process runtime would
    start): the real pre-flight check and runtime choice run before it."""
    seen: list = []

    def reached(cfg, run_dir, *args, **kwargs):
        seen.append((cfg, run_dir))
        raise Reached

    monkeypatch.setattr(experiments.api, "_launch", reached)
    saved = signal.getsignal(signal.SIGTERM)
    yield seen
    signal.signal(signal.SIGTERM, saved)


def _cli(capsys, argv: list[str]) -> tuple[int | None, str]:
    """(exit code, stderr); None when the input reached the guard."""
    try:
        code = cli.main(argv)
    except Reached:
        code = None
    return code, capsys.readouterr().err


def _sets(values: dict) -> list[str]:
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


def _refused(capsys, argv: list[str], *says: str) -> str:
    code, err = _cli(capsys, argv)
    assert code == 2, (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    assert err.startswith("fedpriv: error: "), (argv, err)
    for text in says:
        assert text in err, (argv, text, err)
    return err


def _no_run_folder(results: Path) -> None:
    """At most results-dir itself (the pre-flight check writes a file in it): no run."""
    assert not results.exists() or not any(results.iterdir()), list(results.iterdir())


# --------------------------------------------------------------- keys without effect


@pytest.mark.parametrize(("values", "says"), [
    ({"model": "small-cnn", "mlp-hidden": "100"},
     "mlp-hidden = '100' has no effect with model = 'small-cnn': remove it, or set model = "
     "'mlp'."),
    ({"mlp-hidden": "4294967297"},  # the default model: small-cnn for mnist
     "mlp-hidden = '4294967297' has no effect with model = 'auto' (small-cnn for mnist)"),
    ({"model": "mlp", "mlp-hidden": "２００"}, "written with the digits 0-9"),
    ({"model": "mlp", "mlp-hidden": "2_00"}, "written with the digits 0-9"),
    ({"dataset": "cifar10", "data-dir": "/nonexistent", "model": "cnn", "mlp-hidden": "64"},
     "mlp-hidden = '64' has no effect with model = 'cnn'"),
    ({"invert-tv": 0.5},
     "invert-tv = 0.5 has no effect with leakage-rounds = '' (no round is observed, so no "
     "attack runs): remove it, or set leakage-rounds (e.g. leakage-rounds = '1')."),
    ({"observed-examples": 3}, "observed-examples = 3 has no effect with leakage-rounds = ''"),
    ({"attacks": "mia", "mia-candidates": 20}, "mia-candidates = 20 has no effect"),
    ({"server-trap": "binning-disguised"},
     "server-trap = 'binning-disguised' has no effect with server = 'honest': remove it, or "
     "set server = 'malicious'."),
    ({"server": "malicious", "leakage-rounds": "1", "reference-fraction": 0.1},
     "attacks = 'labels,invert,mia' does not name 'imprint', the attack that reads the "
     "records out of the trap"),
])
def test_keys_without_effect_are_refused_before_any_work(capsys, accepted, values, says):
    _refused(capsys, ["run", *_sets(values)], says)
    assert accepted == []


@pytest.mark.parametrize("values", [
    {"model": "mlp", "mlp-hidden": "64,32"},
    {"features": "embeddings", "mlp-hidden": "64"},  # auto: an mlp head
    {"dataset": "breast-cancer", "mlp-hidden": "16"},  # auto: mlp for tabular rows
    {"leakage-rounds": "1", "invert-tv": 0.5, "observed-examples": 3},
    {"server": "malicious", "leakage-rounds": "1", "reference-fraction": 0.1,
     "leakage-clients": "aggregate", "attacks": "imprint", "server-trap": "binning-disguised"},
    {"prune-update": 0.5, "reference-fraction": 0.1},  # act without observed rounds
])
def test_the_same_keys_pass_where_they_act(capsys, accepted, values):
    code, err = _cli(capsys, ["run", *_sets(values)])
    assert code is None, err
    flat = accepted[0][0].flat()
    assert all(flat[k] == KEYS[k].parse(_given(k, str(v))) for k, v in values.items())


def test_the_registry_knows_each_built_in_datasets_shape_and_auto_model_as_the_models_do():
    from tasks.datasets import dataset_meta
    from tasks.models import resolve_model_name
    from tasks.registry import DATASETS, auto_model

    for name in DATASETS.names:
        shape = dataset_meta(name).input_shape
        assert DATASETS.info(name).input_shape == shape, name
        assert auto_model(shape) == resolve_model_name("auto", shape)


# --------------------------------------------------------------- --supernodes


@pytest.mark.parametrize(("values", "says"), [
    ({"runtime": "ray"}, "runtime = 'ray' with --supernodes"),
    ({"train-together": "true"}, "train-together = true with --supernodes"),
])
def test_what_supernodes_cannot_do_is_refused_before_any_process(capsys, launched, tmp_path,
                                                                 values, says):
    results = tmp_path / "results"
    err = _refused(capsys, ["run", "--supernodes", *_sets(values), "--set",
                            f"results-dir={results}"], says)
    assert "drop --supernodes" in err.lower(), err
    assert launched == []
    _no_run_folder(results)


def test_a_ray_cluster_with_supernodes_is_refused_and_plain_supernodes_pass():
    with pytest.raises(ConfigError, match="ray-address = '127.0.0.1:6379' with --supernodes"):
        choose(validate({"ray-address": "127.0.0.1:6379"}), cuda=False, supernodes=True)
    with pytest.raises(ConfigError) as err:  # every problem, one paragraph each
        choose(validate({"runtime": "ray", "ray-address": "127.0.0.1:6379"}), cuda=False,
               supernodes=True)
    assert str(err.value).count("\n  - ") == 2
    assert choose(validate({}), cuda=False, supernodes=True).name == "deployment"


# --------------------------------------------------------------- sweep-cells, ray-address


def test_a_sweep_cells_file_that_cannot_be_read_is_refused_before_start(capsys, launched,
                                                                       tmp_path):
    results = tmp_path / "results"
    bad = tmp_path / "cells.json"
    bad.write_text(json.dumps({"cells": [{"index": 1}]}))
    for value, says in (("1e9", "sweep-cells = '1e9' cannot be read (No such file"),
                        (str(tmp_path / "absent.json"), "cannot be read (No such file"),
                        (str(bad), "is not a sweep's cells file")):
        _refused(capsys, ["run", "--set", f"sweep-cells={value}", "--set",
                          f"results-dir={results}", "--set", "runtime=ray"],
                 says, "leave it empty to run one configuration")
    assert launched == []
    _no_run_folder(results)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ray_address_where_nothing_listens_is_refused_before_start(capsys, launched,
                                                                    tmp_path):
    from experiments.preflight.checks import ray_head_answers

    results = tmp_path / "results"
    port = _free_port()
    _refused(capsys, ["run", "--set", f"ray-address=127.0.0.1:{port}", "--set",
                      f"results-dir={results}"],
             f"ray-address = '127.0.0.1:{port}': nothing answers there (Connection refused)",
             f"ray start --head --port {port}")
    assert launched == []
    _no_run_folder(results)
    with socket.socket() as head:  # something that answers passes the probe
        head.bind(("127.0.0.1", 0))
        head.listen()
        ray_head_answers(f"127.0.0.1:{head.getsockname()[1]}")


# --------------------------------------------------------------- tracking stores


def _hold_locked(db: Path, ready: threading.Event, done: threading.Event) -> None:
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("CREATE TABLE IF NOT EXISTS t (a)")
    con.execute("BEGIN EXCLUSIVE")
    ready.set()
    done.wait(30)
    con.execute("ROLLBACK")
    con.close()


def test_tracking_stores_that_cannot_be_written_are_refused_before_start(capsys, accepted,
                                                                         tmp_path):
    cases = []
    folder = tmp_path / "folder"
    (folder / "mlflow.db").mkdir(parents=True)
    cases.append(("mlflow", {"results-dir": folder}, "mlflow.db' is a folder"))
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "mlflow.db").write_text("not a database")
    cases.append(("mlflow", {"results-dir": garbage}, "not a writable SQLite database"))
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / "mlruns").write_text("")
    cases.append(("mlflow", {"results-dir": artifacts}, "mlruns' is a file, not a folder"))
    run_dir = tmp_path / "given-run"
    run_dir.mkdir()
    (run_dir / "tensorboard").write_text("")
    cases.append(("tensorboard", {"run-dir": run_dir}, "tensorboard' is a file"))
    cases.append(("tensorboard", {"results-dir": artifacts / "mlruns" / "under-a-file"},
                  "cannot be made"))
    for tracker, where, says in cases:
        _refused(capsys, ["run", "--set", f"tracking={tracker}", *_sets(where)],
                 f"tracking = '{tracker}': ", says, "tracking = 'none'")
    locked = tmp_path / "locked"
    locked.mkdir()
    ready, done = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_locked, args=(locked / "mlflow.db", ready, done))
    holder.start()
    try:
        assert ready.wait(10)
        _refused(capsys, ["run", "--set", "tracking=mlflow", "--set",
                          f"results-dir={locked}"], "another process holds it locked")
    finally:
        done.set()
        holder.join()
    assert accepted == []
    # the same store once free, and a fresh results-dir, pass
    for tracker, results in (("mlflow", locked), ("tensorboard", tmp_path / "new")):
        code, err = _cli(capsys, ["run", "--set", f"tracking={tracker}", "--set",
                                  f"results-dir={results}"])
        assert code is None, err


def _read_only(path: Path) -> bool:
    """Make ``path`` unwritable even for root (chattr +i); False where that is impossible."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return True
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def _writable_again(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    path.chmod(0o755)


def test_tracking_into_a_read_only_folder_is_refused_before_start(capsys, accepted, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    if not _read_only(results):
        pytest.skip("cannot make a folder read-only here (chattr +i as root)")
    try:
        for tracker in ("tensorboard", "mlflow"):
            _refused(capsys, ["run", "--set", f"tracking={tracker}", "--set",
                              f"results-dir={results}"], "is read-only")
    finally:
        _writable_again(results)
    assert accepted == []


# --------------------------------------------------------------- paths


def test_paths_with_spaces_and_non_ascii_work_and_a_newline_is_refused(capsys, launched,
                                                                       tmp_path):
    results = tmp_path / "rés ults ☃"
    data = tmp_path / "dätä dir"
    data.mkdir()
    for key, value in (("results-dir", "a\nb"), ("data-dir", f"{data}\n"),
                       ("results-dir", f"{tmp_path}/x\ty")):
        _refused(capsys, ["run", "--set", f"{key}={value}"], key,
                 "must not contain control characters")
    # (runtime = 'ray': the in-process runtime's child is not warmed up for nothing)
    code, err = _cli(capsys, ["run", "--set", f"results-dir={results}", "--set",
                              f"data-dir={data}", "--set", "num-clients=2", "--set",
                              "runtime=ray"])
    assert code is None, err  # through the pre-flight check to where the run starts
    cfg, run_dir = launched[0]
    assert (cfg.results.results_dir, cfg.data.data_dir) == (str(results), str(data))
    assert run_dir.parent == results


# --------------------------------------------------------------- plugins

PLUGINS = {
    "p_raises": "raise RuntimeError('no GPU here')\n",
    "p_exits": "import sys\nsys.exit(3)\n",
    "p_needs": "import fedpriv_no_such_dependency\n",
    "p_builtin": ("from tasks.registry import MODELS\n\n@MODELS.register('cnn')\n"
                  "def cnn(input_shape, num_classes, hidden=()):\n    raise AssertionError\n"),
    "p_twin_a": ("from tasks.registry import MODELS\n\n@MODELS.register('twin')\n"
                 "def twin(input_shape, num_classes, hidden=()):\n    raise AssertionError\n"),
    "p_twin_b": ("from tasks.registry import MODELS\n\n@MODELS.register('twin')\n"
                 "def twin(input_shape, num_classes, hidden=()):\n    raise AssertionError\n"),
    "p_model_raises": ("from tasks.registry import MODELS\n\n@MODELS.register('bad-model')\n"
                       "def bad(input_shape, num_classes, hidden=()):\n"
                       "    raise ValueError('factory exploded')\n"),
    "p_model_42": ("from tasks.registry import MODELS\n\n@MODELS.register('forty-two')\n"
                   "def forty_two(input_shape, num_classes, hidden=()):\n    return 42\n"),
}

# The CLI run in a child for each case, the run itself guarded as in this file's fixtures;
# one JSON line per case: exit code (None: reached the run) and stderr.
DRIVER = textwrap.dedent("""
    import contextlib, io, json, sys
    import experiments.api as api
    from experiments.cli import main as cli

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    api._launch = reached
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except Reached:
                code = None
        print(json.dumps({"code": code, "err": err.getvalue()}), flush=True)
""")


def test_plugins_that_fail_are_named_in_one_paragraph_before_any_work(tmp_path):
    folder = tmp_path / "plugins"
    folder.mkdir()
    for name, text in PLUGINS.items():
        (folder / f"{name}.py").write_text(text)
    results = tmp_path / "results"
    cases = [
        ("fedpriv_no_such_plugin", {}, ["plugins: the module 'fedpriv_no_such_plugin' was "
                                        "not found", "add that folder to PYTHONPATH"]),
        ("p_raises", {}, ["importing 'p_raises' failed (RuntimeError: no GPU here)"]),
        ("p_exits", {}, ["importing 'p_exits' called sys.exit(3)", "without a word"]),
        ("p_needs", {}, ["importing 'p_needs' failed (ModuleNotFoundError: No module named "
                         "'fedpriv_no_such_dependency')"]),
        ("p_builtin", {}, ["importing 'p_builtin' failed", "model 'cnn' is already "
                           "registered (by tasks.models:mcmahan_cnn)"]),
        ("p_twin_a,p_twin_b", {}, ["importing 'p_twin_b' failed", "model 'twin' is already "
                                   "registered (by p_twin_a:twin)"]),
        ("p_model_raises", {"model": "bad-model"},
         ["model = 'bad-model', which the plugin 'p_model_raises' registers, failed in the "
          "pre-flight check: it raised ValueError: factory exploded", "Fix it in "
          "p_model_raises"]),
        ("p_model_42", {"model": "forty-two"},
         ["model = 'forty-two', which the plugin 'p_model_42' registers, returned int 42 "
          "instead of a torch.nn.Module", "Fix its factory in p_model_42"]),
    ]
    argvs = [["run", "--set", f"plugins={plugins}", *_sets(values), "--set",
              f"results-dir={results}"] for plugins, values, _ in cases]
    res = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], cwd=folder,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(cases), res.stdout + res.stderr
    for (plugins, _, says), got in zip(cases, lines, strict=True):
        err = got["err"]
        assert got["code"] == 2, (plugins, got)
        assert err.startswith("fedpriv: error: ") and "Traceback" not in err, (plugins, err)
        assert "RuntimeError: the pre-flight check crashed" not in err, (plugins, err)
        for text in says:
            assert text in err, (plugins, text, err)
    assert "Traceback" not in res.stderr, res.stderr  # nor from the pre-flight child
    _no_run_folder(results)


# --------------------------------------------------------------- the seeded fuzz

EDGES: dict[str, list] = {  # each key's edge values, good and bad, as typed on a command line
    "runtime": ["auto", "inprocess", "ray", "Ray", "in-process", "''"],
    "train-together": ["true", "false", "yes", "1"],
    "ray-address": ["''", "127.0.0.1:6379", "head.lab:0", "nohost", ":6379", "[::1]:6379"],
    "server": ["honest", "malicious", "evil"],
    "server-trap": ["binning", "binning-disguised", "fishing"],
    "leakage-rounds": ["''", "1", "all", "0", "1,99", "x"],
    "leakage-clients": ["0", "aggregate", "all", "0,3", "-1"],
    "attacks": ["labels,invert,mia", "imprint", "imprint,mia", "mia,audit", "audit", "''",
                "imprnt"],
    "reference-fraction": ["0", "0.1", "0.9", "0.95", "-0.1"],
    "secure-aggregation": ["off", "secagg+", "he", "true", "rsa"],
    "he-min-cohort": ["2", "3", "10", "11", str(INT_MAX), str(INT_MAX + 1), "1", "0", "-5",
                      "2.5"],
    "num-clients": ["1", "2", "10"],
    "fraction-train": ["1.0", "0.5", "0.1"],
    "canaries": ["0", "1", "100", str(INT_MAX), "-1", "1e3"],
    "dp": ["none", "local", "central"],
    "tracking": ["none", "tensorboard", "mlflow", "wandb", "''"],
    "tracking-experiment": ["fedpriv", "my study ☃", "''", '"a\\nb"'],
    # only plugins that register nothing: a registration would last for the whole process
    "plugins": ["''", "' , '", "fedpriv_no_such_plugin", "examples/custom_model.py", "1bad",
                "a..b", "'fedpriv_no_such_plugin, another_missing'"],
}


def _oracle(values: dict) -> tuple[list[str], list[str]]:
    """Keys one of which a refusal must name, for combinations that cannot be meant: (those
    the schema's checks refuse, those refused as having no effect, which are looked for
    only once the schema's checks pass); empty: no verdict (the schema may still refuse)."""
    flat = {k: key.default for k, key in KEYS.items()}
    try:
        flat.update({k: KEYS[k].parse(_given(k, v)) for k, v in values.items()})
    except ConfigError:
        return list(values), []  # a bad value: its own key
    observed = bool(str(flat["leakage-rounds"]).strip())
    attacks = [a.strip() for a in str(flat["attacks"]).split(",") if a.strip()]
    checks = [
        (flat["train-together"] and (flat["runtime"] == "ray" or flat["dp"] == "local"
                                     or flat["secure-aggregation"] != "off"
                                     or flat["canaries"] > 0),
         ["train-together"]),
        (flat["runtime"] == "inprocess" and flat["ray-address"], ["ray-address"]),
        (flat["server"] == "malicious" and not observed, ["server"]),
        (flat["server"] == "malicious" and "imprint" not in attacks, ["server"]),
        (flat["canaries"] > 0 and (not observed or "audit" not in attacks), ["canaries"]),
        (bool(str(flat["plugins"]).replace(",", "").strip()), ["plugins"]),
    ]
    idle = [
        (flat["server-trap"] != "binning" and flat["server"] == "honest", ["server-trap"]),
        ("he-min-cohort" in values and flat["he-min-cohort"] != 2
         and flat["secure-aggregation"] != "he", ["he-min-cohort"]),
        ("tracking-experiment" in values and flat["tracking-experiment"] != "fedpriv"
         and flat["tracking"] != "mlflow", ["tracking-experiment"]),
    ]
    return ([k for applies, keys in checks if applies for k in keys],
            [k for applies, keys in idle if applies for k in keys])


def _given(key: str, text: str):
    """A --set value as the CLI reads it, before the key's own check."""
    return parse_assignment(f"{key}={text}")[1]


def test_the_newest_keys_at_their_edges_and_in_combination(capsys, accepted, tmp_path):
    rng = random.Random(SEED)
    names = list(EDGES)
    refused = passed = 0
    for n in range(240):
        values = {k: rng.choice(EDGES[k]) for k in rng.sample(names, rng.randint(2, 7))}
        values["results-dir"] = str(tmp_path / f"results-{n}")
        argv = ["run", *_sets(values)]
        code, err = _cli(capsys, argv)
        must, idle = _oracle({k: v for k, v in values.items() if k != "results-dir"})
        if code is None:  # accepted: with exactly the values given, and nothing it refuses
            passed += 1
            assert not must and not idle, (argv, must, idle)
            flat = accepted[-1][0].flat()
            for k, v in values.items():
                if k != "results-dir":
                    assert flat[k] == KEYS[k].parse(_given(k, v)), (argv, k, flat[k])
            continue
        refused += 1
        assert code == 2, (argv, code, err)
        assert "Traceback" not in err and err.startswith("fedpriv: error: "), (argv, err)
        assert any(k in err for k in values), (argv, err)  # names a key it was given
        if must:
            assert any(k in err for k in must), (argv, must, err)
        elif idle and "has no effect" in err:  # the schema's checks passed
            assert all(f"{k} = " in err for k in idle), (argv, idle, err)
        # one paragraph per problem: a single error, or a list of them
        body = err.removeprefix("fedpriv: error: ").rstrip("\n")
        assert "\n" not in body or body.startswith("Invalid run config:\n  - "), (argv, err)
    assert refused > 100 and passed > 10, (refused, passed)  # the fuzz reaches both sides
