"""What fedpriv prints and writes for people: progress bars with an ETA (on a terminal
only), the per-round table, the Markdown tables, a sweep's closing table, the
Student-t interval, the Flower config files, the run summary's images, and a plain
`fedpriv run` that says each thing once."""

from __future__ import annotations

import math
import os
import pty
import re
import select
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from .conftest import REPO, only_run, run_cli

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

# a child with a 4-step bar of 0.25 s steps, then one ordinary line
BAR_SCRIPT = textwrap.dedent("""
    import time
    from tasks.progress import Bar
    with Bar("training the thing", 4) as bar:
        for _ in range(4):
            time.sleep(0.25)
            bar.advance()
    print("after the bar", flush=True)
""")


def _on_a_pty(code: str, env: dict[str, str] | None = None, timeout: float = 60) -> str:
    """What ``python -c code`` writes when its stdout and stderr are a terminal."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=slave,
                            stderr=slave, stdin=subprocess.DEVNULL,
                            env={**os.environ, "COLUMNS": "120", **(env or {})})
    os.close(slave)
    out, end = b"", time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([master], [], [], 1)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=10) == 0, out.decode(errors="replace")
    return ANSI.sub("", out.decode(errors="replace"))


def test_a_bar_on_a_terminal_shows_steps_and_an_eta():
    out = _on_a_pty(BAR_SCRIPT)
    # a step part way (which ones a loaded machine's refreshes catch varies)
    assert "training the thing" in out and re.search(r"\b[123]/4\b", out), out
    assert re.search(r"0:00:0\d eta 0:00:0\d", out), out  # elapsed and a computed ETA
    assert "after the bar" in out


def test_a_bar_is_silent_on_a_pipe():
    env = {k: v for k, v in os.environ.items() if k != "FEDPRIV_PROGRESS"}
    res = subprocess.run([sys.executable, "-c", BAR_SCRIPT], cwd=REPO, capture_output=True,
                         text=True, env=env, timeout=60)
    assert res.returncode == 0
    assert res.stdout == "after the bar\n" and res.stderr == ""


def test_a_childs_relayed_bar_is_drawn_by_the_cli_and_not_printed(tmp_path):
    """The in-process runtime's apps write to a pipe: with FEDPRIV_PROGRESS=relay they
    send their bar as lines, which the CLI's LogFilter draws on its terminal (and keeps
    out of the printed output and flwr.log) while the ServerApp's lines print as before."""
    child = tmp_path / "child.py"
    child.write_text(BAR_SCRIPT.replace('print("after the bar"',
                                        'print("[fedpriv] after the bar"'))
    parent = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from experiments.runtime.procs import stream_child
        from experiments.runtime.runner import LogFilter
        from tasks.progress import relay_to_children
        relay_to_children()
        log = LogFilter(Path({str(tmp_path / "flwr.log")!r}), False, print)
        code = stream_child([sys.executable, {str(child)!r}], log)
        log.close()
        print("exit", code)
    """)
    out = _on_a_pty(parent, env={"PYTHONPATH": str(REPO)})
    # the bar as rich draws it (under load the last relayed state may still be 0/4, whose
    # ETA is unknown: -:--:--)
    assert "training the thing" in out and re.search(r"\d/4 .*eta (0:00:0\d|-:--:--)", out), out
    assert "after the bar" in out and "exit 0" in out
    assert "[fedpriv-progress]" not in out  # drawn, not printed
    log = (tmp_path / "flwr.log").read_text()
    assert "after the bar" in log and "fedpriv-progress" not in log


def test_relayed_progress_is_throttled_and_short_steps_send_nothing():
    from tasks.progress import MARK

    quick = "from tasks.progress import Bar\nwith Bar('quick', 3) as b:\n    b.advance(3)\n"
    env = {**os.environ, "FEDPRIV_PROGRESS": "relay"}
    res = subprocess.run([sys.executable, "-c", quick], cwd=REPO, capture_output=True,
                         text=True, env=env, timeout=60)
    assert res.stdout == ""  # a step shorter than RELAY_EVERY_S is not worth a bar
    res = subprocess.run([sys.executable, "-c", BAR_SCRIPT], cwd=REPO, capture_output=True,
                         text=True, env=env, timeout=60)
    relayed = [line for line in res.stdout.splitlines() if line.startswith(MARK)]
    # at most one per advance and the end (under load every 0.25 s step may pass 0.5 s)
    assert 1 <= len(relayed) <= 5 and relayed[-1].endswith('"end": true}'), res.stdout


def test_the_round_table_stays_aligned_for_huge_nan_and_inf_losses():
    from server.console import table_header, table_row

    for eps in (None, 2.5):
        lines = [table_header(eps is not None)]
        for loss in (0.25, 5.05e31, -1.5e300, float("nan"), float("inf")):
            lines.append(table_row(12, {"accuracy": 0.9, "loss": loss}, {"loss": loss},
                                   "100/100", 1234.5, eps))
        lines.append(table_row(0, {"accuracy": 0.1, "loss": 2.3}, None, "-", None, eps))
        bars = {tuple(m.start() for m in re.finditer(r"\|", line)) for line in lines}
        assert len(bars) == 1 and len({len(line) for line in lines}) == 1, "\n".join(lines)
        assert "5.05e+31" in lines[2] and "nan" in lines[4] and "inf" in lines[5]
        assert not any("\x1b" in line for line in lines)  # plain text: it goes to a pipe


def test_markdown_tables_keep_cells_as_written_and_escape_pipes():
    from tasks.markdown import drop_empty_columns, markdown_table

    lines = markdown_table(["name", "acc"], [["a|b", "0.8200"], ["c", None]], ["left", "right"])
    assert re.fullmatch(r"\|:-+\|-+:\|", lines[1]), lines  # left, right aligned
    assert "0.8200" in lines[2] and r"a\|b" in lines[2]
    # every row has the header's number of (unescaped) separators
    assert {len(re.findall(r"(?<!\\)\|", line)) for line in lines} == {3}
    head, rows = drop_empty_columns(["a", "b", "c"], [[1, "", None], [2, "", "x"]], keep=())
    assert head == ["a", "c"] and rows == [[1, None], [2, "x"]]


def _sweep_cells(tmp_path: Path):
    from experiments.sweep.spec import Cell, SweepSpec

    spec = SweepSpec("demo", tmp_path / "demo.toml", {"dataset": "mnist"},
                     {"lr": [0.1, 0.05, 0.01]})
    cells = [Cell(i, {"lr": lr}, None, "finished", None, tmp_path / "cells" / f"{i:02d}",
                  result={"final": {"accuracy": acc}, "best": {"accuracy": acc, "round": 2},
                          "rounds": 2, "steady-round-s": 0.51, "wall-s": 12.0})
             for i, (lr, acc) in enumerate(((0.1, 0.81), (0.05, 0.79)), 1)]
    cells.append(Cell(3, {"lr": 0.01}, None, "invalid", "lr too small", None))
    return spec, cells


def _md_rows(lines: list[str]) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines
            if line.startswith("|") and not re.fullmatch(r"[|:\- ]+", line)]


def test_a_sweep_ends_with_its_table_without_empty_columns(tmp_path, capsys):
    from experiments.sweep.table import print_table, write_table

    spec, cells = _sweep_cells(tmp_path)
    write_table(tmp_path, spec, cells)
    print_table(tmp_path, spec, cells)  # what run_sweep prints when the sweep ends
    printed = _md_rows(capsys.readouterr().out.splitlines())  # not a terminal: Markdown
    md = _md_rows((tmp_path / "sweep.md").read_text().splitlines())
    for table in (printed, md):
        head, rows = table[0], table[1:]
        assert head == ["cell", "lr", "status", "final-acc", "best-acc", "best-round",
                        "rounds", "steady-round-s", "wall-s"], head
        assert [r[:3] for r in rows] == [["1", "0.1", "finished"], ["2", "0.05", "finished"],
                                         ["3", "0.01", "invalid"]]
        assert all(any(r[i] for r in rows) for i in range(len(head)))  # no empty column
    csv_head = (tmp_path / "sweep.csv").read_text().splitlines()[0].split(",")
    assert {"epsilon", "mia-auc", "run-dir", "error"} <= set(csv_head)  # the CSV keeps all


def test_student_t_interval_matches_the_table_value():
    from experiments.sweep.stats import fmt_ci, mean_ci

    # n = 4, sd = 2.5820, t(0.975, 3) = 3.1824463: half-width 3.1824463 * 2.5820 / 2
    mean, half = mean_ci([2, 4, 6, 8])
    assert mean == 5 and half == pytest.approx(3.1824463 * math.sqrt(20 / 3) / 2, rel=1e-6)
    assert mean_ci([0.5, 0.5, 0.5]) == (0.5, 0.0)
    assert math.isnan(mean_ci([0.7])[1]) and fmt_ci([0.7, None]) == "0.7000 (n=1)"


def test_t_intervals_are_scipy_stats_intervals():
    """The sweep tables' and the leakage spread's intervals (scipy.special's quantile)
    against scipy.stats.t.interval with scipy.stats.sem, over sizes and levels."""
    import numpy as np
    from scipy import stats

    from experiments.leakage.spread import mean_interval
    from experiments.sweep.stats import mean_ci

    rng = np.random.default_rng(3)
    for n in (2, 3, 5, 30):
        xs = rng.normal(20.0, 4.0, n)
        for level in (0.9, 0.95, 0.99):
            lo, hi = stats.t.interval(level, n - 1, loc=xs.mean(), scale=stats.sem(xs))
            mean, half = mean_ci(list(xs), level)
            assert mean == pytest.approx(xs.mean(), rel=1e-12)
            assert half == pytest.approx((hi - lo) / 2, rel=1e-9)
            assert mean_interval(list(xs), level)["ci95"] == pytest.approx([lo, hi], rel=1e-12)


def test_flower_config_files_quote_what_toml_needs(tmp_path):
    from experiments.deploy.connection import Connection
    from experiments.runtime.superlink import flower_config

    odd = tmp_path / 'a "quoted" \\ folder' / "ca.crt"
    odd.parent.mkdir()
    odd.write_text("x")
    link = Connection.__new__(Connection)  # the fields only: __post_init__ reads the cert
    object.__setattr__(link, "address", "10.0.0.1:9093")
    object.__setattr__(link, "ca", odd)
    text = flower_config("deploy", {"deploy": link.table()})
    assert tomllib.loads(text)["superlink"] == {
        "default": "deploy", "deploy": {"address": "10.0.0.1:9093",
                                        "root-certificates": str(odd.resolve())}}
    both = tomllib.loads('[superlink]\ndefault = "x"\n\n' + link.toml("x"))
    assert both["superlink"]["x"]["root-certificates"] == str(odd.resolve())


def test_the_summary_embeds_the_release_scatter_once(tmp_path):
    from server.summary import SCATTER_LINE, embed_release_scatter, write_summary
    from tasks.config import validate
    from tasks.results.folder import RunFolder
    from tasks.results.info import RunInfo

    run = RunFolder(tmp_path)
    write_summary(run, validate({}), RunInfo(status="finished"), [])
    assert not embed_release_scatter(tmp_path)  # no image: nothing to show
    (tmp_path / "plots").mkdir(exist_ok=True)
    (tmp_path / "plots" / "release_scatter.png").write_bytes(b"png")
    assert embed_release_scatter(tmp_path) and not embed_release_scatter(tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert text.count(SCATTER_LINE) == 1
    assert text.index("![loss]") < text.index(SCATTER_LINE)
    write_summary(run, validate({}), RunInfo(status="finished"), [])  # written again
    assert (tmp_path / "summary.md").read_text().count(SCATTER_LINE) == 1


def test_a_plain_run_says_the_data_and_the_results_folder_once(tmp_path):
    res = run_cli("run", "--set", "num-server-rounds=1", "--set", "num-clients=2",
                  "--set", f"results-dir={tmp_path}", "--set", "save-model=false",
                  timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = str(only_run(tmp_path))
    assert res.stdout.count(run_dir) == 1, res.stdout
    assert res.stdout.count("embedded MNIST subset") == 1, res.stdout  # the data, once
    table = [line for line in res.stdout.splitlines() if line.count("|") >= 5]
    assert len(table) == 3 and len({len(line) for line in table}) == 1, res.stdout
    assert "[fedpriv-progress]" not in res.stdout


def test_the_summarys_round_table_is_markdown_even_when_the_loss_explodes(tmp_path):
    from server.summary import write_summary
    from tasks.config import validate
    from tasks.results.folder import RunFolder
    from tasks.results.info import RunInfo
    from tasks.results.ledger import RoundRecord

    records = [RoundRecord(round=r, test={"accuracy": acc, "loss": loss},
                           train={"loss": loss} if r > 1 else {}, sampled=[0, 1],
                           clients=[{}, {}], failures=[], time={"round-s": 0.5},
                           tampered="binning" if r == 2 else None)
               for r, acc, loss in ((1, 0.5, 1.25), (2, 0.1, 5.05e31), (3, 0.1, float("nan")))]
    write_summary(RunFolder(tmp_path), validate({}), RunInfo(status="finished"), records)
    rows = _md_rows((tmp_path / "summary.md").read_text().splitlines())
    assert rows == [["round", "test acc", "test loss", "train loss", "clients", "round s"],
                    ["1", "0.5000", "1.2500", "-", "2/2", "0.50"],
                    ["2 (tampered)", "0.1000", "5.05e+31", "5.05e+31", "2/2", "0.50"],
                    ["3", "0.1000", "nan", "nan", "2/2", "0.50"]]


def test_on_a_terminal_the_sweep_table_never_cuts_a_value_short(tmp_path):
    """rich lays the table out for the terminal's width (a header word a line); where even
    that does not fit, the sweep prints the Markdown table and the terminal wraps it."""
    code = textwrap.dedent(f"""
        from pathlib import Path
        from tests.test_output import _sweep_cells
        from experiments.sweep.table import print_table
        spec, cells = _sweep_cells(Path({str(tmp_path)!r}))
        print_table(Path({str(tmp_path)!r}), spec, cells)
    """)
    wide = _on_a_pty(code, env={"COLUMNS": "120"})
    assert "…" not in wide and "|" not in wide and "0.7900" in wide and "steady" in wide
    narrow = _on_a_pty(code, env={"COLUMNS": "50"})
    assert "…" not in narrow and "| 2    | 0.05 | finished | 0.7900" in narrow


def test_fedpriv_sweep_ends_with_the_comparison_table(tmp_path):
    sweep = tmp_path / "tiny.toml"
    sweep.write_text(tomli_w.dumps({
        "name": "tiny", "preset": "mnist",
        "fixed": {"num-server-rounds": 1, "num-clients": 2, "save-model": False,
                  "results-dir": str(tmp_path / "results")},
        "grid": {"lr": [0.05, 0.1]}}))
    res = run_cli("sweep", str(sweep), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    end = res.stdout[res.stdout.rindex("done: test accuracy"):]
    table = _md_rows(end.splitlines())
    head, rows = table[0], table[1:]
    assert head[:3] == ["cell", "lr", "status"] and "final-acc" in head, end
    assert [r[:3] for r in rows] == [["1", "0.05", "finished"], ["2", "0.1", "finished"]]
    assert all(any(r[i] for r in rows) for i in range(len(head)))  # no empty column
    md = _md_rows((only_run(tmp_path / "results" / "sweeps") / "sweep.md").read_text()
                  .splitlines())
    assert md == table  # the same table as sweep.md
    assert "sweep finished in" in end.splitlines()[-1]


def test_the_summarys_round_table_starts_at_round_0_and_shows_epsilon_with_dp(tmp_path):
    from server.summary import write_summary
    from tasks.config import validate
    from tasks.results.folder import RunFolder
    from tasks.results.info import RunInfo
    from tasks.results.ledger import RoundRecord

    records = [RoundRecord(round=r, test={"accuracy": 0.5 + 0.1 * r, "loss": 1.0 / r},
                           train={"loss": 1.0}, sampled=[0, 1], clients=[{}, {}], failures=[],
                           time={"round-s": 0.5},
                           privacy={"mode": "central", "epsilon": 1.25 * r})
               for r in (1, 2)]
    info = RunInfo(status="finished", initial={"accuracy": 0.1, "loss": 2.3})
    write_summary(RunFolder(tmp_path), validate({"dp": "central"}), info, records)
    rows = _md_rows((tmp_path / "summary.md").read_text().splitlines())
    assert rows == [["round", "test acc", "test loss", "train loss", "clients", "round s",
                     "epsilon"],
                    ["0", "0.1000", "2.3000", "-", "-", "-", "0"],
                    ["1", "0.6000", "1.0000", "1.0000", "2/2", "0.50", "1.25"],
                    ["2", "0.7000", "0.5000", "1.0000", "2/2", "0.50", "2.5"]]
