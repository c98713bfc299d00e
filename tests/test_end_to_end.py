"""Real federated runs through the real CLI: the in-process runtime (the default), Flower's
simulation runtime with Ray actors (runtime = "ray"), real SuperNodes. Marked slow."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from experiments.runtime.owned_folders import HOME_PREFIX, OWNER_FILE
from experiments.runtime.superlink import LocalSuperLink, flower_executable
from tasks.results.folder import read_run_info

from .conftest import REPO, ledger_json, only_run, run_cli
from .test_cli import _processes_with

pytestmark = pytest.mark.slow
SMALL = ["--set", "num-clients=3", "--set", "num-server-rounds=2"]


def test_cli_run_end_to_end(tmp_path, results):
    res = run_cli("run", *SMALL, "--set", f"results-dir={results}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    run = only_run(results)
    records = ledger_json(run)
    assert [r["round"] for r in records] == [1, 2]
    info = read_run_info(run)
    assert info["status"] == "finished" and info["num-clients"] == 3
    assert info["initial"]["accuracy"] < 0.2  # an untrained model is at chance (0.1)
    assert records[-1]["test"]["accuracy"] > 0.5 > info["initial"]["accuracy"]
    for r in records:
        assert r["sampled"] == [0, 1, 2] and len(r["clients"]) == 3 and not r["failures"]
        assert r["train"]["num-examples"] == 4000
        assert r["time"]["round-s"] > 0
    # in simulation the server pairs nodes with partitions (sorted node ids): no message
    parts = json.loads((run / "partitions.json").read_text())["clients"]
    assert [p["partition-id"] for p in parts] == [0, 1, 2]
    assert [p["node-id"] for p in parts] == sorted(p["node-id"] for p in parts)
    sizes = {c["partition-id"]: c["num-examples"] for c in records[0]["clients"]}
    assert sum(sizes.values()) == 4000  # learned from the replies, as clients train
    for name in ("config.toml", "summary.md", "model.pt", "flwr.log", "plots/accuracy.png",
                 "plots/loss.png", "plots/label_distribution.png"):
        assert (run / name).is_file(), name
    assert "num-clients = 3" in (run / "config.toml").read_text()
    assert "round | test acc" in res.stdout and "    2 |" in res.stdout
    assert "embedded MNIST subset" in res.stdout  # the run says which MNIST it used


def test_sweep_reproducibility_and_failed_cell(tmp_path, results):
    sweep = tmp_path / "repro.toml"
    sweep.write_text(f"""
name = "repro"
[fixed]
num-clients = 4
fraction-train = 0.5
num-server-rounds = 1
classes-per-client = 11
results-dir = "{results}"
[grid]
seed = [7, 7, 8]
partitioner = ["iid", "pathological"]
""")
    # classes-per-client = 11 > 10 classes: the pathological cells fail their data check
    res = run_cli("sweep", str(sweep), cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr  # some cells failed
    out = only_run(results / "sweeps")
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert [r["status"] for r in rows] == ["finished", "invalid"] * 3
    assert "only 10 classes" in rows[1]["error"]
    first = [ledger_json(out / r["run-dir"])[0] for r in rows if r["status"] == "finished"]
    a, b, c = first
    assert len(a["sampled"]) == 2
    assert a["sampled"] == b["sampled"]
    assert a["test"] == b["test"] and a["clients"][0]["train-loss"] == b["clients"][0]["train-loss"]
    assert c["test"] != a["test"]
    for name in ("sweep.md", "plots/accuracy_vs_round.png", "plots/final_accuracy.png"):
        assert (out / name).is_file()
    # --replot redraws the comparison plots of a finished sweep from its folder
    for plot in (out / "plots").glob("*.png"):
        plot.unlink()
    res = run_cli("sweep", str(out), "--replot", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert {p.name for p in (out / "plots").glob("*.png")} == {"accuracy_vs_round.png",
                                                               "final_accuracy.png"}


def _untimed(clients):
    return [{k: v for k, v in c.items() if not k.endswith("-s")} for c in clients]


def test_sweep_cells_in_one_simulation_equal_separate_runs(tmp_path, results):
    # Two cells that differ in federation size, privacy and seed: run inside one
    # simulation (warm clients serve every cell), then each in a simulation of its own
    # (--separate). Every run's ledger must be the same either way. (The seeds table of
    # a sweep over seeds: tests/test_cli.py, in-process.)
    sweep = tmp_path / "together.toml"
    sweep.write_text(f"""
name = "together"
[fixed]
num-server-rounds = 2
save-model = false
results-dir = "{results}"
[[cells]]
num-clients = 3
seed = 3
[[cells]]
num-clients = 2
dp = "local"
noise-multiplier = 1.0
batch-size = 64
seed = 4
""")
    together = run_cli("sweep", str(sweep), cwd=tmp_path)
    assert together.returncode == 0, together.stdout + together.stderr
    assert "2 runs (2 cells)" in together.stdout
    assert together.stdout.count("run(s) in-process") == 1
    separate = run_cli("sweep", str(sweep), "--separate", cwd=tmp_path)
    assert separate.returncode == 0, separate.stdout + separate.stderr
    a, b = sorted((results / "sweeps").iterdir())
    rows = list(csv.DictReader(open(a / "sweep.csv")))
    assert [(r["num-clients"], r["seed"]) for r in rows] == [("3", "3"), ("2", "4")]
    for r in rows:
        one, other = ledger_json(a / r["run-dir"]), ledger_json(b / r["run-dir"])
        assert [x["test"] for x in one] == [x["test"] for x in other]
        assert [x["sampled"] for x in one] == [x["sampled"] for x in other]
        assert [_untimed(x["clients"]) for x in one] == [_untimed(x["clients"]) for x in other]
        assert [x.get("privacy") for x in one] == [x.get("privacy") for x in other]
    assert ledger_json(a / rows[1]["run-dir"])[-1]["privacy"]  # the DP cell kept its ledger


def _cell_lines(stdout: str) -> list[tuple[int, str]]:
    """(cell, text) of the lines a side-by-side sweep tagged with their cell."""
    return [(int(m.group(1)), m.group(2)) for line in stdout.splitlines()
            if (m := re.match(r"cell (\d+): (.*)", line))]


def test_sweep_cells_side_by_side_equal_one_at_a_time(tmp_path, results):
    # Three cells share the in-process simulation two at a time: a plain one sampling
    # half its clients (Flower's sampling draws from the process' `random`), a local-DP
    # one and a central-DP one; the SecAgg+ cell runs alone. Every cell's ledger must be
    # the one it gets when the cells run one after another: a cell's server seeds the
    # global generators and initialises its model under a lock, and its nodes have
    # Contexts of their own.
    sweep = tmp_path / "beside.toml"
    sweep.write_text(f"""
name = "beside"
[fixed]
num-clients = 4
num-server-rounds = 2
save-model = false
results-dir = "{results}"
[[cells]]
fraction-train = 0.5
seed = 3
[[cells]]
dp = "local"
noise-multiplier = 1.0
batch-size = 64
fraction-train = 0.5
seed = 4
[[cells]]
secure-aggregation = "secagg+"
seed = 5
[[cells]]
dp = "central"
noise-multiplier = 0.05
max-noise-to-signal = 0
seed = 6
""")
    beside = run_cli("sweep", str(sweep), "--cells-at-once", "2", cwd=tmp_path)
    assert beside.returncode == 0, beside.stdout + beside.stderr
    assert "4 run(s) in-process on 4 clients, 2 at a time" in beside.stdout
    lines = _cell_lines(beside.stdout)
    cells_seen = [c for c, _ in lines]
    # cells 1 and 2 ran at once: cell 2 said something before cell 1 was done
    first_done = next(i for i, (c, t) in enumerate(lines) if c == 1 and t.startswith("done"))
    assert 2 in cells_seen[:first_done]
    # the SecAgg+ cell ran alone: its lines are untagged, and no tagged line falls between
    # its start and its end
    start = beside.stdout.index("cell 3 (3/4)")
    end = beside.stdout.index("done:", start)
    assert not re.search(r"^cell \d+: ", beside.stdout[start:end], re.MULTILINE)
    alone = run_cli("sweep", str(sweep), "--cells-at-once", "1", cwd=tmp_path)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert "at a time" not in alone.stdout and not _cell_lines(alone.stdout)
    a, b = sorted((results / "sweeps").iterdir())
    rows = list(csv.DictReader(open(a / "sweep.csv")))
    assert [r["status"] for r in rows] == ["finished"] * 4
    for r in rows:
        one, other = ledger_json(a / r["run-dir"]), ledger_json(b / r["run-dir"])
        assert len(one) == 2
        assert [x["test"] for x in one] == [x["test"] for x in other]
        assert [x["sampled"] for x in one] == [x["sampled"] for x in other]
        assert [_untimed(x["clients"]) for x in one] == [_untimed(x["clients"]) for x in other]
        assert [x.get("privacy") for x in one] == [x.get("privacy") for x in other]
    assert len(ledger_json(a / rows[0]["run-dir"])[0]["sampled"]) == 2


def test_flwr_run_native_uses_the_same_apps(tmp_path):
    results = tmp_path / "native"
    with LocalSuperLink(cwd=tmp_path) as link:
        proc = subprocess.run(
            [flower_executable("flwr"), "run", str(REPO), LocalSuperLink.CONNECTION, "--stream",
             "--run-config", f"num-server-rounds=6 target-accuracy=0.3 results-dir='{results}'",
             "--federation-config", "num-supernodes=3"],
            env=link.env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    run = only_run(results)
    info = read_run_info(run)
    assert info["status"] == "finished"
    assert "the simulation has 3 nodes" in out  # num-clients=10 default, 3 supernodes
    # target-accuracy stops the run at the first round that reaches it
    accs = [r["test"]["accuracy"] for r in ledger_json(run)]
    assert len(accs) == info["target-reached-round"] < 6
    assert accs[-1] >= 0.3 and all(a < 0.3 for a in accs[:-1])
    assert "reached target-accuracy" in info["stopped-early"]


@pytest.mark.parametrize("runtime, child", [("ray", "flower-superlink"),
                                             ("inprocess", "experiments.runtime.inprocess")])
def test_ctrl_c_stops_every_process_and_keeps_finished_rounds(tmp_path, results, runtime,
                                                              child):
    cmd = [sys.executable, "-m", "experiments.cli", "run", "--set", "num-clients=3",
           "--set", "num-server-rounds=500", "--set", f"results-dir={results}",
           "--set", f"runtime={runtime}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=os.environ)
    started = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if line.strip().startswith("2 |"):
            break
        assert time.monotonic() < deadline, "no round finished in time"
    started = psutil.Process(proc.pid).children(recursive=True)
    assert any(child in " ".join(p.cmdline()) for p in started)
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, rest
    gone, alive = psutil.wait_procs(started, timeout=15)
    assert not alive, [p.cmdline() for p in alive]
    run = only_run(results)
    assert read_run_info(run)["status"] == "interrupted"
    assert len(ledger_json(run)) >= 2
    # what was kept and how to go on: said on the terminal and in summary.md, with plots
    assert f"continue it with: fedpriv run --resume {run}" in rest, rest
    summary = (run / "summary.md").read_text()
    assert "- **interrupted**" in summary and f"fedpriv run --resume {run}" in summary
    assert (run / "plots" / "accuracy.png").is_file()


def _start_and_wait_for_round(results, marker, runtime="auto"):
    """A long `fedpriv run` in a subprocess, once its first round has finished."""
    cmd = [sys.executable, "-m", "experiments.cli", "run", "--set", "num-clients=3",
           "--set", "num-server-rounds=500", "--set", f"results-dir={results}",
           "--set", f"runtime={runtime}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "FEDPRIV_TEST_MARKER": marker})
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if line.strip().startswith("1 |"):
            break
        assert time.monotonic() < deadline, "no round finished in time"
    return proc


def _gone(marker, timeout=120.0):
    deadline = time.monotonic() + timeout
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _processes_with(marker)


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _listening(pids):
    """(process name, address) of every listening TCP socket of ``pids``."""
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out += [(proc.name(), c.laddr.ip) for c in proc.net_connections("inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return out


def _folders_of(pid):
    """The private temporary folders that name ``pid`` their owner."""
    import tempfile
    from pathlib import Path

    out = []
    for home in Path(tempfile.gettempdir()).glob(f"{HOME_PREFIX}*"):
        try:
            if json.loads((home / OWNER_FILE).read_text())["pid"] == pid:
                out.append(home.name.rsplit("-", 1)[0])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out)


@pytest.mark.parametrize("runtime", ["ray", "inprocess"])
def test_kill_9_of_fedpriv_leaves_no_process_and_no_private_folder(tmp_path, results,
                                                                  runtime):
    marker = uuid.uuid4().hex
    proc = _start_and_wait_for_round(results, marker, runtime)
    homes = {psutil.Process(p).environ().get("FLWR_HOME") for p in _processes_with(marker)}
    homes.discard(None)
    listening = _listening(_processes_with(marker))
    if runtime == "ray":
        # SuperLink, SuperExec, flwr-simulation, Ray's GCS, raylet and workers: loopback
        assert any("gcs_server" in name for name, _ in listening), listening
        assert all(ip in LOOPBACK for _, ip in listening), listening
        assert homes and all(os.path.isdir(h) for h in homes)
    else:  # one child process and its client workers (a core each, at most one a
        # client), listening on nothing
        workers = min(len(os.sched_getaffinity(0)), 3)
        assert len(_processes_with(marker)) == 2 + (workers if workers > 1 else 0)
        assert listening == []
    # the staged app, the label plot's folder, and Flower's home or the runtime's own
    assert {"fp-app", "fp-labels"} <= set(_folders_of(proc.pid)), _folders_of(proc.pid)
    proc.kill()  # SIGKILL: no cleanup code in fedpriv runs
    proc.wait(timeout=30)
    # Ray: the keeper stops SuperLink, SuperExec, simulation, Ray; in-process: the kernel
    # stops the child (parent-death signal), which records the crash itself
    left = _gone(marker)
    assert left == [], [psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]
    assert not any(os.path.exists(h) for h in homes)
    assert _folders_of(proc.pid) == []  # removed by the keeper / the orphaned child
    info = read_run_info(only_run(results))  # and records the outcome fedpriv could not
    assert info["status"] == "crashed" and f"fedpriv (pid {proc.pid}) was killed" in info["error"]
    assert len(ledger_json(only_run(results))) >= 1


@pytest.mark.parametrize("how", ["sigterm", "double-ctrl-c"])
def test_sigterm_and_a_double_ctrl_c_stop_everything_and_say_so(tmp_path, results, how):
    marker = uuid.uuid4().hex
    proc = _start_and_wait_for_round(results, marker)
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:  # the second Ctrl-C lands while the first one's cleanup runs
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == (143 if how == "sigterm" else 130), rest
    assert _gone(marker) == []
    info = read_run_info(only_run(results))
    assert info["status"] == "interrupted"
    assert ("SIGTERM" in info["error"]) == (how == "sigterm")


def test_kill_9_of_the_superlink_is_reported_and_cleaned_up(tmp_path, results):
    marker = uuid.uuid4().hex
    proc = _start_and_wait_for_round(results, marker, "ray")
    link = [p for p in _processes_with(marker)
            if "flower-superlink" in " ".join(psutil.Process(p).cmdline())]
    assert len(link) == 1
    os.kill(link[0], signal.SIGKILL)
    rest = proc.communicate(timeout=180)[0]
    assert proc.returncode == 1, rest
    assert f"SuperLink (pid {link[0]}) exited with code -9" in rest
    assert _gone(marker) == []  # SuperExec, the simulation and Ray, re-parented: stopped
    run = only_run(results)
    time.sleep(3)  # an orphaned ServerApp would have overwritten run.json by now
    info = read_run_info(run)
    assert info["status"] == "crashed" and "SuperLink" in info["error"]


def test_real_supernodes_on_loopback(tmp_path, results):
    """The same apps on a deployment-mode SuperLink with two real flower-supernode processes."""
    marker = uuid.uuid4().hex
    res = run_cli("run", "--supernodes", "--set", "num-clients=2", "--set", "num-server-rounds=1",
                  "--set", f"results-dir={results}", cwd=tmp_path,
                  env={"FEDPRIV_TEST_MARKER": marker})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 real SuperNodes on loopback" in res.stdout
    run = only_run(results)
    info = read_run_info(run)
    assert info["status"] == "finished" and info["num-clients"] == 2
    (record,) = ledger_json(run)
    assert record["sampled"] == [0, 1] and record["test"]["accuracy"] > 0.5
    assert _gone(marker) == []  # SuperExec processes notice their parent is gone


def test_the_python_api_runs_a_federation_and_reads_it_back(results):
    import fedpriv

    lines: list[str] = []
    result = fedpriv.run(num_clients=3, num_server_rounds=2, results_dir=str(results),
                         echo=lines.append)
    assert result.ok, result.error
    assert [r.round for r in result.ledger] == [1, 2] and result.accuracy > 0.5
    frame = result.frame()
    assert list(frame["round"]) == [0, 1, 2]  # round 0: the initial model
    assert list(frame["test_accuracy"])[1:] == [r.accuracy for r in result.ledger]
    assert any("in-process runtime" in line for line in lines)  # progress
    assert any("round | test acc" in line for line in lines)
    again = fedpriv.load(result.run_dir)
    assert again.ledger == result.ledger and again.status == "finished" and again == result
    assert result.plots["accuracy"] == result.run_dir / "plots" / "accuracy.png"


def test_kill_9_mid_run_then_resume_equals_an_uninterrupted_run(tmp_path, results):
    """Local DP: kill -9 of fedpriv after round 2, `fedpriv run --resume`, and the ledger
    (accuracy, loss, sampled clients, every client's epsilon) equals a run never killed."""
    keys = ["--set", "num-clients=3", "--set", "num-server-rounds=4", "--set", "dp=local",
            "--set", "noise-multiplier=1.0"]
    whole = run_cli("run", *keys, "--set", f"results-dir={results / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "run", *keys, "--set",
                             f"results-dir={results / 'killed'}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if line.strip().startswith("2 |"):
            break
        assert time.monotonic() < deadline, "no second round in time"
    proc.kill()
    proc.wait(timeout=30)
    killed = only_run(results / "killed")
    deadline = time.monotonic() + 120
    while read_run_info(killed).get("status") == "running" and time.monotonic() < deadline:
        time.sleep(0.5)  # the keeper records the crash
    assert read_run_info(killed)["status"] == "crashed"
    res = run_cli("run", "--resume", str(killed), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resuming after round" in res.stdout
    a, b = ledger_json(only_run(results / "whole")), ledger_json(killed)
    assert [r["round"] for r in b] == [1, 2, 3, 4]
    for key in ("test", "sampled", "privacy"):
        assert [r[key] for r in b] == [r[key] for r in a], key
    info = read_run_info(killed)
    assert info["status"] == "finished" and info["resumed"][0]["status"] == "crashed"
    again = run_cli("run", "--resume", str(killed), cwd=tmp_path)
    assert again.returncode == 2 and "already finished" in again.stderr

    # A simulated client's Ray worker killed after round 1: Flower would keep handing
    # jobs to the dead actor; fedpriv restarts the simulation from the checkpoint and the
    # ledger is again the uninterrupted run's, every client in every round.
    # (on Ray, against the in-process run above: the runtimes give the same ledger)
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "run", *keys, "--set",
                             f"results-dir={results / 'worker'}", "--set", "runtime=ray"],
                            cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "FEDPRIV_TEST_MARKER": marker})
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.strip().startswith("1 |"):
            break
    actors = [p for p in _processes_with(marker)
              if "ClientAppActor" in " ".join(psutil.Process(p).cmdline())]
    assert actors, [psutil.Process(p).cmdline() for p in _processes_with(marker)]
    os.kill(actors[0], signal.SIGKILL)
    out += proc.communicate(timeout=600)[0]
    text = "".join(out)
    assert proc.returncode == 0, text
    assert "restarting the simulation from the checkpoint of round" in text
    worker = only_run(results / "worker")
    c = ledger_json(worker)
    for key in ("test", "sampled", "privacy"):
        assert [r[key] for r in c] == [r[key] for r in a], key
    assert all(len(r["clients"]) == 3 for r in c)
    assert read_run_info(worker)["resumed"][0]["automatic"] is True
    assert _gone(marker) == []


def test_a_diverging_run_says_so_in_the_terminal_run_json_and_summary(tmp_path, results):
    """lr = 50 blows the clients' loss up in round 1: every place a user looks says the
    model diverged, with the round and the cause (the run itself goes on, as asked)."""
    res = run_cli("run", "--set", "num-clients=3", "--set", "num-server-rounds=3",
                  "--set", "lr=50", "--set", f"results-dir={results}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("warning: the model diverged at round 1") == 1  # said once
    run = only_run(results)
    info = read_run_info(run)
    assert info["diverged"]["round"] == 1 and "train loss" in info["diverged"]["cause"]
    assert len(ledger_json(run)) == 3
    assert "**the model diverged at round 1**" in (run / "summary.md").read_text()


def test_a_closed_output_pipe_stops_the_run_as_interrupted_with_its_cause(tmp_path, results):
    """`fedpriv run | head`: when the reader goes away the run stops as on Ctrl-C, and
    run.json says why (it said "crashed" with no error)."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "run", "--set",
                             "num-clients=3", "--set", "num-server-rounds=500", "--set",
                             f"results-dir={results}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "FEDPRIV_TEST_MARKER": marker})
    for _ in range(3):
        proc.stdout.readline()
    proc.stdout.close()  # as `head -3` does
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "the output's reader went away" in err and "Traceback" not in err
    info = read_run_info(only_run(results))
    assert info["status"] == "interrupted" and "reader went away" in info["error"]
    assert _gone(marker) == []


def test_ctrl_c_in_the_python_api_says_where_the_rounds_are_in_a_short_traceback(tmp_path,
                                                                                 results):
    """A notebook's interrupt of fedpriv.run: RunInterrupted (still a KeyboardInterrupt)
    naming the folder and fedpriv.resume, its traceback a few lines, not fedpriv's
    internals."""
    code = ("import fedpriv\n"
            f"fedpriv.run(num_clients=3, num_server_rounds=500, results_dir={str(results)!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ)
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if line.strip().startswith("2 |"):
            break
        assert time.monotonic() < deadline, "no round finished in time"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    run = only_run(results)
    assert "experiments.api.RunInterrupted: the run was interrupted" in err, err
    assert f"fedpriv.resume({str(run)!r})" in err, err
    assert err.count('File "') <= 3, err  # the caller's line and fedpriv.run's, no deeper
    assert read_run_info(run)["status"] == "interrupted"
