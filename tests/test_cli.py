"""The command line: --help documents every key; bad input fails fast, before any process starts."""

import os
import subprocess
import sys
import uuid

import psutil
import pytest

from experiments.configs import PRESETS, SWEEPS, read_preset, resolve
from experiments.preflight.checks import preflight
from experiments.sweep.spec import load_sweep
from tasks.config import SCHEMA, ConfigError, defaults, validate

from .conftest import REPO, run_cli


def _processes_with(marker: str) -> list[int]:
    """Live processes that inherited ``marker`` in their environment (ours, however deep)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("FEDPRIV_TEST_MARKER") == marker:
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def test_run_help_documents_every_key_with_default_and_allowed_values():
    res = run_cli("run", "--help")
    assert res.returncode == 0
    for key in SCHEMA:
        assert f"  {key.name} = " in res.stdout, key.name
    assert 'dataset = "mnist"    [mnist | fashion-mnist | cifar10 | cifar100 | breast-cancer |' \
        ' shakespeare | femnist]' in res.stdout
    assert "fraction-train = 1.0    [(0, 1]]" in res.stdout


def test_version_names_the_package_and_the_commit():
    import fedpriv

    res = run_cli("--version")
    assert res.returncode == 0, res.stderr
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert res.stdout.startswith(f"fedpriv {fedpriv.__version__} (commit {head[:12]}")
    assert fedpriv.__version__ != "unknown"


def test_run_info_names_a_missing_package_instead_of_failing():
    from importlib.metadata import version

    from tasks.version import installed_version

    assert installed_version("numpy") == version("numpy")
    assert installed_version("no-such-distribution-fedpriv") == "not installed"


def test_keys_command_prints_the_schema_as_toml_and_text():
    import tomllib

    res = run_cli("keys", "--toml")
    assert res.returncode == 0
    assert tomllib.loads(res.stdout) == defaults()  # what pyproject.toml must hold
    with open(REPO / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["tool"]["flwr"]["app"]["config"] == tomllib.loads(res.stdout)
    text = run_cli("keys").stdout
    for group in {k.group for k in SCHEMA}:
        assert f"\n{group}:\n" in f"\n{text}"
    assert '  client-sampling = "fixed"    [fixed | poisson | cyclic | cyclic-poisson]' in text


BAD_INPUT = [
    (["--set", "dataset=imagenet"], "dataset = 'imagenet' must be one of"),
    (["--set", "model=vgg"], "model = 'vgg' must be one of"),
    (["--set", "strategy=fedfoo"], "strategy = 'fedfoo' must be one of"),
    (["--set", "partitioner=zipf"], "partitioner = 'zipf' must be one of"),
    (["--set", "partitioner=dirichlet", "--set", "dirichlet-alpha=0"],
     "dirichlet-alpha = 0 must be > 0"),
    (["--set", "fraction-train=1.5"], "fraction-train = 1.5 must be <= 1"),
    (["--set", "fraction-train=0"], "fraction-train = 0 must be > 0"),
    (["--set", "num-server-rounds=0"], "num-server-rounds = 0 must be >= 1"),
    (["--set", "num-clietns=3"], "unknown key 'num-clietns'. Did you mean num-clients"),
    (["--set", "num-clients=5000"], "num-clients = 5000 is more than the 4,000 training"),
    (["--set", "data-dir=/nonexistent/fedpriv-data"], "does not exist"),
    (["--set", "dataset=cifar10"], "cifar-10-batches-py"),
    (["--set", "dataset=breast-cancer", "--set", "model=cnn"], "cannot read breast-cancer"),
    (["--config", "no-such-preset"], "preset 'no-such-preset' not found"),
    (["--set", "lr"], "is not of the form key=value"),
    (["--set", "anonymizer=ksame"], "set features = 'embeddings'"),
    (["--set", "features=embeddings", "--set", "anonymizer=ksame", "--set", "k=5000"],
     "k = 5000 is larger than the"),
    (["--set", "features=embeddings", "--set", "anonymizer=density",
      "--set", "dbscan-eps=0.01"], "found no cluster"),
    (["--set", "dp=local", "--set", "target-epsilon=0.0001", "--set", "accountant=rdp"],
     "cannot be met"),
    (["--set", "dp=local", "--set", "delta=0.01"], "is not below 1/N"),
    (["--set", "dp=central", "--set", "secure-aggregation=true"], "needs client-side clipping"),
    (["--set", "seed=1e20"], "seed = 1e+20 must be at most 2^63 - 1"),
    (["--set", "hash-salt=a\nb"], "must not contain control characters"),
    (["--set", "data-dir=in\tdir"], "must not contain control characters"),
    (["--config", ""], "--config '' names no preset"),
    (["--set", "model=mlp", "--set", "mlp-hidden=100000000,100000000"], "more than a quarter "
                                                                         "of this machine"),
    (["--set", "dp=local", "--set", "target-epsilon=1e300"], "target-epsilon = 1e+300 must "
                                                             "be <= 10000"),
    (["--set", f"client-cpus={(os.cpu_count() or 1) + 1}"], "CPU cores"),
    (["--set", "runtime=inprocess", "--set", "ray-address=10.0.0.5:6379"],
     "cannot use a Ray cluster"),
    (["--config", "num-clients=5"], "did you mean --set num-clients=5?"),  # `run num-clients=5`
]


@pytest.mark.parametrize("args, fragment", BAD_INPUT)
def test_bad_input_is_refused_with_one_paragraph(tmp_path, args, fragment):
    # What `fedpriv run` checks before starting anything, in this process: the schema,
    # then the pre-flight check on the data (the subprocess test below runs the CLI).
    preset = args[1] if args[0] == "--config" else None
    sets = [a for a in args[1::2]] if preset is None else []
    with pytest.raises(ConfigError) as err:
        cfg = resolve(preset, [*sets, f"results-dir={tmp_path / 'results'}"])
        preflight(cfg)
    assert fragment in str(err.value)
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


@pytest.mark.parametrize("args, fragment", [BAD_INPUT[0], BAD_INPUT[9], BAD_INPUT[19]])
def test_bad_input_fails_before_any_process_starts(tmp_path, args, fragment):
    marker = uuid.uuid4().hex
    res = run_cli("run", "--set", f"results-dir={tmp_path / 'results'}", *args, cwd=tmp_path,
                  env={"FEDPRIV_TEST_MARKER": marker})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "fedpriv: error:" in res.stderr  # (after any pre-flight progress lines)
    assert fragment in res.stderr[res.stderr.index("fedpriv: error:"):]
    assert "Traceback" not in res.stderr
    assert "starting Flower SuperLink" not in res.stdout
    assert "in-process runtime" not in res.stdout
    assert _processes_with(marker) == []  # nothing was left running
    results = tmp_path / "results"
    assert not results.exists() or not any(results.iterdir())  # no run folder was made


@pytest.mark.parametrize("args, fragment", [
    (["--set", "dataset=cifar10"], "cifar10 needs a data-dir holding torchvision's layout"),
    (["--set", "num-clients=5000"], "more than the 4,000 training examples"),
    (["--set", "data-dir=/nonexistent/fedpriv-data"], "does not exist")])
def test_errors_that_need_no_data_come_before_torch_is_imported(args, fragment, monkeypatch):
    """A missing file or folder, or more clients than embedded MNIST's digits, is said by
    the first, torch-free step of the pre-flight check: no child process starts."""
    from experiments import api

    started = []
    monkeypatch.setattr(api, "preflight_isolated", lambda cfg: started.append(cfg))
    monkeypatch.setattr(api, "InProcessLink", lambda: started.append("child"))
    with pytest.raises(ConfigError, match=fragment):
        api.run_config(resolve(None, args[1::2]), echo=None)
    assert started == []


def test_every_bundled_preset_and_sweep_is_valid():
    presets = sorted(p.stem for p in PRESETS.glob("*.toml"))
    sweeps = sorted(p.stem for p in SWEEPS.glob("*.toml"))
    assert {"mnist", "fashion-mnist", "cifar10", "breast-cancer"} <= set(presets)
    for name in presets:
        validate(read_preset(name))  # a whole run config, cross-checks included
    for name in sweeps:
        assert load_sweep(name).cells()  # load_sweep validates every cell
    res = run_cli("presets")
    assert res.returncode == 0
    assert all(name in res.stdout for name in presets + sweeps)


def test_presets_command_flags_an_invalid_preset(tmp_path, monkeypatch):
    import experiments.configs as configs
    from experiments.cli.main import main

    (tmp_path / "good.toml").write_text("num-clients = 4\n")
    (tmp_path / "bad.toml").write_text("num-clients = 0\n")
    monkeypatch.setattr(configs, "PRESETS", tmp_path)
    monkeypatch.setattr(configs, "SWEEPS", tmp_path / "none")
    assert main(["presets"]) == 2


def test_sweep_dry_run_lists_the_grid():
    res = run_cli("sweep", "clients-partitioning", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "8 cells" in res.stdout
    assert "num-clients=5, partitioner=shard, local-epochs=2" in res.stdout


def test_sweep_with_an_invalid_cell_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[grid]\nnum-clients = [5, 0]\n')
    res = run_cli("sweep", str(bad), "--dry-run")
    assert res.returncode == 2 and "num-clients = 0 must be >= 1" in res.stderr


@pytest.mark.parametrize("text, fragment", [
    ("fixed = 3\n[grid]\nlr = [0.1]\n", "fixed must be a table, got int 3"),
    ("grid = [1, 2]\n", "grid must be a table"),
    ("cells = 'x'\n[grid]\nlr = [0.1]\n", "cells must be a list of tables"),
    ("[grid]\n" + "".join(f"{k} = [{', '.join(str(i + 1) for i in range(10))}]\n"
                          for k in ("seed", "num-clients", "local-epochs", "num-server-rounds",
                                    "batch-size", "min-train-clients", "eval-batch-size")),
     "has 10,000,000 cells"),
])
def test_malformed_or_huge_sweep_files_are_refused_at_once(tmp_path, text, fragment):
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    res = run_cli("sweep", str(bad), "--dry-run")
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_replot_of_a_folder_that_is_not_a_sweep_is_refused(tmp_path):
    res = run_cli("sweep", str(tmp_path / "missing"), "--replot")
    assert res.returncode == 2 and "is not a finished sweep's folder" in res.stderr
    assert "Traceback" not in res.stderr


def test_docs_config_reference_is_current():
    from experiments.cli.keys import config_markdown

    assert (REPO / "docs" / "CONFIG.md").read_text() == config_markdown(), \
        "regenerate with: fedpriv keys --markdown > docs/CONFIG.md"


def test_the_final_line_lists_what_the_run_wrote(tmp_path):
    from experiments.cli.main import list_results

    for name in ("summary.md", "run.json", "flwr.log", "plots/accuracy.png", "plots/loss.png"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x")
    line = list_results(tmp_path)
    assert line == "run.json, summary.md, plots/{accuracy,loss}.png"
    assert "model.pt" not in line  # save-model = false wrote none
    for name in ("plots/accuracy.pdf", "plots/loss.pdf"):  # a PDF beside every PNG
        (tmp_path / name).write_text("x")
    assert list_results(tmp_path) == "run.json, summary.md, plots/{accuracy,loss}.{png,pdf}"


def test_unusable_files_and_folders_are_refused_before_work(tmp_path):
    junk = tmp_path / "weights.pt"
    junk.write_bytes(os.urandom(2000))
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    cases = [
        ([f"backbone-weights={junk}", "features=embeddings"], "cannot be read as a PyTorch"),
        ([f"data-dir={a_file}"], "is a file, not a folder"),
        ([f"data-dir={a_file}", "download=true"], "is a file, not a folder"),
        (["results-dir=/proc"], "cannot be written to"),  # a read-only file system
        ([f"results-dir={a_file}/results"], "cannot be created"),
    ]
    for sets, fragment in cases:
        with pytest.raises(ConfigError, match=fragment):
            preflight(resolve(None, sets))


def test_a_sweep_over_seeds_tables_each_cells_mean_and_interval(tmp_path):
    """sweep.md's seeds table: per cell, Student's t 95% interval over its finished runs
    (a failed seed left out, n says how many), beside the row of every run."""
    from experiments.sweep.spec import Cell, SweepSpec
    from experiments.sweep.table import write_table

    spec = SweepSpec("seeds", tmp_path / "seeds.toml", {}, {"lr": [0.1]}, seeds=[1, 2, 3])
    accs = {1: 0.80, 2: 0.84, 3: None}
    cells = [Cell(i, {"lr": 0.1}, None, "finished" if accs[s] else "failed",
                  None if accs[s] else "boom", None, seed=s,
                  result={"final": {"accuracy": accs[s]}} if accs[s] else {})
             for i, s in enumerate((1, 2, 3), 1)]
    write_table(tmp_path, spec, cells)
    md = (tmp_path / "sweep.md").read_text()
    assert "Mean ± 95% interval (Student's t) over seeds [1, 2, 3], finished runs only" in md
    # mean 0.82, half-width t(0.975, 1) * sd / sqrt(2) = 12.706 * 0.02828 / 1.414 = 0.2541
    assert "| lr=0.1 | 0.8200 ± 0.2541 (n=2) |" in " ".join(md.split())  # any padding
    assert "cell 3 (lr=0.1, seed=3): boom" in md


def test_a_listing_cut_short_by_its_reader_exits_quietly():
    """`fedpriv keys | head -2`: nothing was running, so no error and no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "keys"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err, err


def test_a_positional_preset_underscores_and_did_you_mean_for_values(tmp_path):
    res = run_cli("run", "fashion-mnist", "--set", "num_clients=3", "--set", "dp=locl")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "dp = 'locl' is not allowed; did you mean 'local'?" in res.stderr
    assert "unknown key" not in res.stderr  # num_clients is num-clients
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a results-dir that cannot be made: stops after the header
    res = run_cli("run", "fashion-mnist", "--set", "num_clients=3",
                  "--set", f"results-dir={blocked}")
    assert res.returncode == 2 and "cannot be created" in res.stderr, res.stderr
    assert res.stdout.startswith("fedpriv run · fashion-mnist · 3 clients"), res.stdout
    strategy = run_cli("run", "--set", "strategy=fedavgg")
    assert "strategy = 'fedavgg' must be one of fedavg" in strategy.stderr
    assert "Did you mean 'fedavg'?" in strategy.stderr
    twice = run_cli("run", "mnist", "--config", "mnist")
    assert twice.returncode == 2 and "the preset is given twice" in twice.stderr
    missing = run_cli("run", "mnsit")
    assert missing.returncode == 2 and "preset 'mnsit' not found" in missing.stderr
    assert "Did you mean 'mnist'?" in missing.stderr
