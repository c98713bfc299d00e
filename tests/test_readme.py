"""The README shows what the code prints: its Python session is run as a doctest, and the
main job's output is compared with a real run of it (times, dates and paths masked)."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

from .conftest import REPO, run_cli

README = (REPO / "README.md").read_text()


def _block(after: str, fence: str) -> str:
    """The first ```fence block after the heading or sentence ``after``."""
    start = README.index(after)
    body = README.index(f"```{fence}\n", start) + len(fence) + 4
    return README[body:README.index("```", body)]


@pytest.mark.slow
def test_the_readme_python_session_prints_what_it_shows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # results/ of the session go here
    session = _block("## Python API", "pycon")
    test = doctest.DocTestParser().get_doctest(session, {}, "README.md", "README.md", 0)
    out: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=out.append)
    assert runner.failures == 0 and runner.tries >= 8, "".join(out)


_MASKS = [
    (re.compile(r"\S*/results/\S*"), "<path>"),  # the results folder
    (re.compile(r"\d+(\.\d+)? ?s\b"), "<t>"),  # durations
]


def _mask(line: str) -> str:
    for pattern, to in _MASKS:
        line = pattern.sub(to, line)
    return line.rstrip()


def _matches(shown: list[str], printed: list[str]) -> bool:
    """Every README line in order, where a line ``...`` stands for any number of lines."""
    pattern = "\n".join(".*?" if s.strip() == "..." else re.escape(_mask(s)) for s in shown)
    return re.fullmatch(pattern, "\n".join(_mask(p) for p in printed), re.S) is not None


def test_the_readme_main_job_output_is_what_it_prints(tmp_path):
    shown = _block("The main job prints", "").strip("\n").splitlines()
    res = run_cli("run", "--set", f"results-dir={tmp_path / 'results'}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    printed = res.stdout.strip("\n").splitlines()
    assert _matches(shown, printed), "README:\n" + "\n".join(shown) + "\n\nprinted:\n" + \
        "\n".join(printed)


def test_the_mask_keeps_what_must_match():
    assert _matches(["a 0.93 in 6.1 s · /x/results/r", "...", "end"],
                    ["a 0.93 in 7.0 s · /y/results/q", "b", "c", "end"])
    assert not _matches(["a 0.93 in 6.1 s"], ["a 0.94 in 6.1 s"])  # a figure differs
    assert not _matches(["a", "b"], ["a"])
    assert Path(REPO / "README.md").is_file()


def _commands() -> list[str]:
    """Every `fedpriv ...` command in the README's bash blocks (continuations joined,
    comments dropped), except those naming a folder of the reader's (``<run>``, a dated
    results folder)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith("fedpriv ") and "<" not in line and "results/2026" not in line:
                out.append(line)
    return out


def test_every_readme_command_is_accepted(tmp_path):
    """Each `fedpriv run` of the README passes the config and pre-flight checks (refused
    keys, central DP that cannot learn), each `fedpriv sweep` loads with every cell
    valid, and every other command parses."""
    import shlex

    from experiments.cli.parser import build_parser
    from experiments.configs import resolve
    from experiments.preflight.checks import preflight
    from experiments.sweep.spec import load_sweep

    commands = _commands()
    assert sum(c.startswith("fedpriv run ") for c in commands) >= 8, commands
    for command in commands:
        argv = shlex.split(command)[1:]
        if "--help" in argv:
            continue
        args = build_parser().parse_args(argv)
        sets = [*args.set, f"results-dir={tmp_path}"] if hasattr(args, "set") else []
        if args.command == "run":
            cfg = resolve(args.preset or args.config, sets)
            if not cfg.data.data_dir:  # a folder of the reader's is checked when it exists
                preflight(cfg)
        elif args.command == "sweep":
            load_sweep(args.file, sets)
