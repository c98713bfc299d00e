"""fedpriv's Python API: run, sweep and load from a notebook or a script.

The same code as the CLI (``fedpriv run`` and ``fedpriv sweep`` are thin layers over
:func:`run_config` and :func:`sweep`); keys are the run-config keys with ``_`` for
``-``, e.g. ``fedpriv.run("mnist", num_clients=10, dp="local", target_epsilon=5)``.
Bad input raises :class:`tasks.config.ConfigError` (one paragraph) before anything
starts; progress lines go to ``echo`` (``print``, so they show in a notebook).
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.config import KEYS, ConfigError, RunConfig, validate
from tasks.config.sections import unknown_key
from tasks.files import damaged
from tasks.results.folder import (
    RUN_INFO,
    RunFolder,
    default_run_name,
    given_run_dir,
    new_run_dir,
    now,
    read_run_info,
    read_saved_config,
)
from tasks.results.ledger import METRICS, RoundRecord, headline_epsilon, read_ledger

from . import arguments as arg
from .arguments import Echo, silent
from .configs import resolve
from .frames import changed, combine, ledger_frame
from .preflight.isolated import Checker, Preflight, preflight_isolated
from .runtime.app_bundle import app_dir
from .runtime.choice import choose, likely_inprocess
from .runtime.inprocess_link import InProcessLink
from .sweep.settings import effective, inert

if TYPE_CHECKING:  # the rest is imported where it is used: the CLI starts its run's child
    import pandas  # before it imports Flower, torch or matplotlib (about a second)

    from .deploy.connection import Connection
    from .runtime.runner import RunOutcome


def _results(value: Any) -> list[Result]:
    """``concat``'s runs: an iterable of at least one :class:`Result`."""
    fix = ("E.g. fedpriv.concat([fedpriv.load('results/a'), fedpriv.load('results/b')]), or "
           "sweep.frame() for a sweep's cells.")
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise arg.refused("concat", "results", value, "a list of Results (what fedpriv.run and "
                       "fedpriv.load return)", fix)
    results = list(value)
    if not results:
        raise ConfigError(f"fedpriv.concat: results is empty; it takes a list of one or more "
                          f"Results to line up in one frame. {fix}")
    for i, r in enumerate(results):
        if not isinstance(r, Result):
            raise arg.refused("concat", f"results[{i}]", r, "a Result (what fedpriv.run and "
                           "fedpriv.load return)", fix)
    return results


class Plots(dict):
    """A run's plots by name (``"accuracy"``, ``"leakage/roc"``) -> PNG path; shown as
    images in a notebook."""

    def _repr_html_(self) -> str:
        return "".join(_img(path, name) for name, path in self.items())


def _img(path: Path, title: str, width: int = 600) -> str:
    """A plot inlined for a notebook: wide enough to read (its 150-dpi pixels scaled to
    the cell), never wider than the cell."""
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure style="display:inline-block;margin:4px;max-width:100%"><img '
            f'style="width:{width}px;max-width:100%" src="data:image/png;base64,{data}"/>'
            f'<figcaption style="text-align:center">{html.escape(title)}</figcaption>'
            "</figure>")


def _rows_html(rows: Sequence[tuple[str, str]]) -> str:
    return "<table>" + "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
                               f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
                               for k, v in rows) + "</table>"


def _leakage_headline(summary: Mapping[str, Any]) -> str:
    """leakage.json in one line: each attack's first few mean scores."""
    parts = []
    for attack, scores in summary.items():
        if not isinstance(scores, Mapping):
            continue
        numbers = [f"{k} {v:.3g}" for k, v in scores.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)][:3]
        verdict = scores.get("claim-consistent")
        if verdict is not None:
            numbers.append("claim holds" if verdict else "CLAIM REJECTED")
        parts.append(f"{attack}: {', '.join(numbers)}")
    return "; ".join(parts)


@dataclass(eq=False)
class Result:
    """One run's folder, read back: its config, ledger (one record per round), outcome and
    files. Two Results are equal when they hold the same run: folder, config, ledger and
    outcome."""

    run_dir: Path
    config: RunConfig
    ledger: list[RoundRecord]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """finished | failed | interrupted | crashed | running."""
        return str(self.info.get("status", "crashed"))

    @property
    def ok(self) -> bool:
        return self.status == "finished"

    @property
    def error(self) -> str | None:
        return self.info.get("error")

    @property
    def accuracy(self) -> float | None:
        """Test accuracy of the global model after the last finished round."""
        return self.ledger[-1].accuracy if self.ledger else None

    @property
    def epsilon(self) -> float | None:
        """The run's headline epsilon (local DP: the largest over clients; central DP:
        client-level), or None without DP; ConfigError naming run.json when it is damaged."""
        _check_info(self.run_dir, self.info, f"the run in {self.run_dir}")
        return headline_epsilon(self.info.get("privacy"))

    @property
    def diverged(self) -> dict[str, Any] | None:
        """The round and cause when the model diverged (run.json), else None."""
        return self.info.get("diverged")

    @property
    def summary(self) -> str:
        path = self.run_dir / "summary.md"
        return path.read_text() if path.exists() else ""

    @property
    def plots(self) -> Plots:
        folder = self.run_dir / "plots"
        return Plots((p.relative_to(folder).with_suffix("").as_posix(), p)
                     for p in sorted(folder.rglob("*.png")))

    @property
    def leakage(self) -> dict[str, Any] | None:
        """The leakage study's summary (leakage.json), when the run observed updates."""
        path = self.run_dir / "leakage.json"
        return json.loads(path.read_text()) if path.exists() else None

    def frame(self, config: str | Sequence[str] = "changed") -> pandas.DataFrame:
        """The run as a pandas DataFrame, one row per round from round 0 (the initial
        model): every number the ledger holds (``test_accuracy``, ``train_loss``,
        ``epsilon``, ``test_auroc``, ``anonymization_...``), the folder name (``run``) and
        settings as columns: ``config="changed"`` the keys not at their default, ``"all"``
        every key, or a list of keys; a key the run's mode never reads (``target_epsilon``
        without local DP) is empty. :func:`concat` puts several runs in one frame."""
        if isinstance(config, str) and config in ("changed", "all"):
            keys = changed([self.config]) if config == "changed" else list(self.config)
        elif isinstance(config, str):
            keys = [_key(config)]
        elif isinstance(config, (list, tuple)) and all(isinstance(k, str) for k in config):
            keys = [_key(k) for k in config]
        else:
            raise arg.refused("Result.frame", "config", config, "'changed' (the keys not at "
                           "their default), 'all', one run-config key, or a list of keys",
                           "E.g. result.frame(config=['dp', 'target_epsilon']).")
        frame = ledger_frame(self.ledger, self.info, self.config, self.run_dir.name, keys)
        for key in inert(keys, self.config):  # empty whatever its value, default included
            frame[key.replace("-", "_")] = None
        return frame

    def _content(self) -> tuple:
        return (self.run_dir.resolve(), json.dumps(self.config.flat(), sort_keys=True),
                json.dumps([r.to_json() for r in self.ledger], sort_keys=True),
                self.status, self.error)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Result):
            return NotImplemented
        return self._content() == other._content()

    __hash__ = None  # type: ignore[assignment]  (mutable, compared by content)

    def __repr__(self) -> str:
        acc = "" if self.accuracy is None else f", accuracy {self.accuracy:.4f}"
        eps = "" if self.epsilon is None else f", epsilon {self.epsilon:.3g}"
        return (f"Result({self.status}, {len(self.ledger)} rounds{acc}{eps}, "
                f"{self.run_dir})")

    def _repr_html_(self) -> str:
        flat = self.config.flat()
        rows = [("run", self.run_dir.name), ("status", self.status),
                ("rounds", f"{len(self.ledger)} of {self.config.federation.num_server_rounds}")]
        if self.accuracy is not None:
            rows.append(("test accuracy", f"{self.accuracy:.4f}"))
        if self.epsilon is not None:
            privacy = self.info.get("privacy") or {}
            delta = privacy.get("delta", privacy.get("delta-max"))
            rows.append(("epsilon", f"{self.epsilon:.3g}"
                         + (f" at delta {delta:.3g}" if isinstance(delta, (int, float)) else "")
                         + (f" ({privacy.get('unit')})" if privacy.get("unit") else "")))
        if self.leakage:
            rows.append(("leakage", _leakage_headline(self.leakage)))
        if self.diverged:
            rows.append(("diverged", f"round {self.diverged.get('round')}: "
                                     f"{self.diverged.get('cause')}"))
        if self.error:
            rows.append(("error", self.error))
        rows += [(k, str(flat[k])) for k in changed([self.config])
                 if k not in ("results-dir", "run-dir")]
        return _rows_html(rows) + self.plots._repr_html_()


def _key(name: str) -> str:
    """A run-config key from a name with dashes or underscores (ConfigError if unknown)."""
    dashed = name.replace("_", "-")
    if dashed not in KEYS:
        raise ConfigError(unknown_key(name))
    return dashed


def concat(results: Iterable[Result]) -> pandas.DataFrame:
    """Several runs in one frame (rows: run x round), with a column for every key set to
    other than its default in any of them, so the runs can be told apart and compared."""
    results = _results(results)
    keys = changed(r.config for r in results)
    return combine([r.frame(keys) for r in results], keys)


# run.json's entries a Result reads, and the types the ServerApp writes them as
_INFO_TYPES: dict[str, tuple[type, ...]] = {
    "status": (str,), "error": (str,), "privacy": (Mapping,), "diverged": (Mapping,),
    "initial": (Mapping,), "stopped-early": (str,)}


def _check_info(run_dir: Path, info: Mapping[str, Any], where: str) -> None:
    """ConfigError naming run.json when an entry a Result reads is not what fedpriv writes
    (e.g. ``privacy`` a text, or an epsilon that is not a number)."""
    for key, types in _INFO_TYPES.items():
        value = info.get(key)
        if value is not None and not isinstance(value, types):
            raise damaged(run_dir / RUN_INFO, f"is damaged: its {key!r} is {arg.shown(value)}, "
                          f"not the {'text' if types == (str,) else 'object'} fedpriv writes",
                          where)
    eps = headline_epsilon(info.get("privacy"))
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))):
        raise damaged(run_dir / RUN_INFO, f"is damaged: its privacy epsilon is {arg.shown(eps)}, "
                      "not a number", where)


def _check_rounds(run_dir: Path, info: Mapping[str, Any], ledger: Sequence[RoundRecord],
                  where: str) -> None:
    """ConfigError naming metrics.jsonl when run.json says the run finished its rounds and
    the ledger holds none of them."""
    if ledger or info.get("status") != "finished" or info.get("stopped-early"):
        return
    what = "is empty" if (run_dir / METRICS).exists() else "is missing"
    done = info.get("rounds-completed")
    raise damaged(run_dir / METRICS, f"{what}, yet run.json says the run finished"
                  + (f" {done} round(s)" if isinstance(done, int) and done else "")
                  + " (its ledger holds one line per round, so there is nothing to read back)",
                  where)


def load(run_dir: str | Path) -> Result:
    """A finished (or interrupted) run folder, read back; ConfigError naming the file when
    one is damaged."""
    path = arg.folder("load", "run_dir", run_dir, "a run's folder",
                   "results/20261122-101500-mnist-fedavg-iid")
    if not path.is_dir() or not (path / "config.toml").exists():
        raise ConfigError(f"{path} is not a fedpriv run folder (no config.toml). Give the "
                          "folder `fedpriv run` printed, e.g. results/20261122-101500-mnist-...")
    return _read(path, f"fedpriv.load({str(path)!r})")


def _read(path: Path, where: str) -> Result:
    """A run folder read back and checked (:func:`load`)."""
    cfg = validate(read_saved_config(path, where))
    ledger, info = read_ledger(path, where), read_run_info(path, where)
    _check_info(path, info, where)
    _check_rounds(path, info, ledger, where)
    return Result(path, cfg, ledger, info)


def runs(results_dir: str | Path = "results") -> Any:
    """Past runs under ``results_dir`` (sweep cells included), one row each, oldest first:
    path, status, dataset, model, clients, rounds, final accuracy, epsilon, start, wall
    time (a pandas DataFrame; ``fedpriv.load(row.path)`` opens one)."""
    from .past_runs import past_runs, runs_frame

    root = arg.folder("runs", "results_dir", results_dir, "a results folder", "results")
    return runs_frame(past_runs(root))


def attack(run_dir: str | Path, attacks: str | Sequence[str] | None = None, *,
           rounds: Sequence[int] | None = None, clients: Sequence[int] | None = None,
           echo: Echo | None = print, **settings: Any) -> Result:
    """Run the leakage attacks on a finished run's observations (what ``fedpriv attack``
    does): ``attacks`` by name (default: the run's ``attacks`` key), only the observed
    ``rounds``/``clients`` given, leakage settings changed by keyword (e.g.
    ``invert_iterations=500``). Writes leakage.jsonl, leakage.json, plots/leakage/ and the
    summary's section; returns the run read back (``.leakage`` holds the summary)."""
    from .leakage.attack import run_attacks

    folder = arg.folder("attack", "run_dir", run_dir, "a finished run's folder with "
                        "observations", "results/20261122-101500-mnist-fedavg-iid")
    if isinstance(attacks, str):
        attacks = [a.strip() for a in attacks.split(",") if a.strip()]
    if attacks is not None and (not isinstance(attacks, Sequence)
                                or not all(isinstance(a, str) for a in attacks)):
        raise arg.refused("attack", "attacks", attacks, "attack names (a list, or one "
                          "comma-separated text), or None for the run's own",
                          "E.g. fedpriv.attack(run_dir, 'invert,mia').")
    sets = [f"{k.replace('_', '-')}={v}" for k, v in
            arg.run_keys("attack", settings).items()]
    run_attacks(folder, list(attacks) if attacks else None, sets, rounds, clients,
                echo=arg.echo("attack", echo))
    return _read(folder, f"fedpriv.attack({str(folder)!r})")


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or a notebook's interrupt) during a run: what was kept and how to go on,
    raised in place of the interrupt's traceback through fedpriv's internals."""

    def __init__(self, message: str, run_dir: Path | None) -> None:
        super().__init__(message)
        self.run_dir = run_dir


def _interrupted(exc: KeyboardInterrupt) -> KeyboardInterrupt:
    """``exc`` as a :class:`RunInterrupted` saying where the rounds so far are; a
    SIGTERM or a closed output (not an interrupt of the user's) is left as it is."""
    from .runtime.procs import OutputClosed, Terminated

    if isinstance(exc, (OutputClosed, Terminated, RunInterrupted)):
        return exc
    run_dir = getattr(exc, "run_dir", None)
    if run_dir is None:
        return RunInterrupted("interrupted before the run started; every process fedpriv "
                              "started has been stopped and no results folder was kept.",
                              None)
    from server.summary import resume_hint

    if not (run_dir / "metrics.jsonl").is_file():
        return RunInterrupted(f"the run was interrupted before it finished a round; every "
                              f"process fedpriv started has been stopped. Its folder "
                              f"{run_dir} holds its config only; start it again.", run_dir)
    return RunInterrupted(f"the run was interrupted; every process fedpriv started has been "
                          f"stopped. Its rounds so far are in {run_dir} (summary.md, "
                          f"plots/); {resume_hint(run_dir)}.", run_dir)


def run_config(cfg: RunConfig, *, name: str | None = None, supernodes: bool = False,
               verbose: bool = False, echo: Echo | None = print) -> Result:
    """Run one validated config (in-process, on Flower's simulation runtime, or on real
    SuperNodes on loopback with ``supernodes``: :mod:`experiments.runtime.choice`) and
    read back what it wrote."""
    if not isinstance(cfg, RunConfig):
        raise arg.refused("run_config", "cfg", cfg, "a validated RunConfig",
                       "Make one with tasks.config.validate({...}), or call "
                       "fedpriv.run(preset, **keys) instead.")
    try:
        return _run_config(cfg, name=arg.name("run_config", name, None),
                           supernodes=arg.flag("run_config", "supernodes", supernodes),
                           verbose=arg.flag("run_config", "verbose", verbose),
                           echo=arg.echo("run_config", echo))
    except KeyboardInterrupt as exc:
        raise _interrupted(exc) from None


def _run_config(cfg: RunConfig, *, name: str | None, supernodes: bool, verbose: bool,
                echo: Echo) -> Result:
    """:func:`run_config` with its arguments checked."""
    _no_resume_key(cfg)
    fed = cfg.federation
    echo(f"fedpriv run · {cfg.data.dataset} · {fed.num_clients} clients "
         f"({cfg.data.partitioner}) · {fed.strategy} · {fed.num_server_rounds} rounds · seed "
         f"{cfg.training.seed}")
    given = given_run_dir(cfg.results)  # an existing run is refused before any work
    _quick_check(cfg)
    with _warm(cfg, supernodes) as warm:
        pre = _checked(cfg, echo, warm.memo_env(), warm.checker())
        choose(cfg, cuda=pre.cuda, supernodes=supernodes)  # a runtime that cannot serve it
        if given is not None:
            given.mkdir(parents=True, exist_ok=True)
        run_dir = given or new_run_dir(cfg.results.results_dir, name or default_run_name(cfg))
        return _launch(cfg, run_dir, pre, supernodes, verbose, echo, warm)


@contextlib.contextmanager
def _warm(cfg: RunConfig, supernodes: bool) -> Iterator[InProcessLink]:
    """The in-process runtime's child, started now if the run will likely need it: it
    imports torch and the apps, then runs the pre-flight check (stopped unused if the
    check refuses the run or the run goes to Ray)."""
    with InProcessLink() as link:
        if likely_inprocess(cfg, supernodes):
            link.start([cfg])
        yield link


def resume(run_dir: str | Path, *, verbose: bool = False, echo: Echo | None = print) -> Result:
    """Continue a crashed, interrupted or failed run from its last checkpointed round, in
    its own folder, with its own config (:mod:`server.checkpoint`)."""
    folder = arg.folder("resume", "run_dir", run_dir, "a crashed or interrupted run's folder",
                     "results/20261122-101500-mnist-fedavg-iid")
    verbose, echo = arg.flag("resume", "verbose", verbose), arg.echo("resume", echo)
    try:
        path, cfg, rounds = _resumable(folder, "fedpriv run --resume", echo)
        with InProcessLink() as link:
            pre = _reopen(path, cfg, rounds, echo, runtime=link)
            return _launch(cfg, path, pre, False, verbose, echo, link)
    except KeyboardInterrupt as exc:
        if getattr(exc, "run_dir", None) is None:
            exc.run_dir = folder  # type: ignore[attr-defined]  # it exists: it is resumed
        raise _interrupted(exc) from None


def _resumable(run_dir: str | Path, command: str, echo: Echo
               ) -> tuple[Path, RunConfig, int]:
    """A resumable run folder (checked before anything starts), its config and the round
    it was checkpointed at."""
    from server.checkpoint import Checkpoint, resumable

    path, cfg = resumable(run_dir)
    rounds = Checkpoint.load(path).round
    echo(f"{command} · {path.name} · round {rounds} of "
         f"{cfg.federation.num_server_rounds} checkpointed")
    return path, cfg, rounds


def _reopen(path: Path, cfg: RunConfig, rounds: int, echo: Echo,
            runtime: InProcessLink | None = None) -> Preflight:
    """The pre-flight check of a resumable run, which is then marked running again; a
    simulated run's ``runtime`` is started for it (and checks it) if it will likely serve
    it, as for a new run."""
    if runtime is None:
        pre = _checked(cfg, echo)
    else:
        if likely_inprocess(cfg):
            runtime.start([cfg])
        pre = _checked(cfg, echo, runtime.memo_env(), runtime.checker())
        choose(cfg, cuda=pre.cuda)  # a runtime that cannot serve it
    RunFolder(path).reopen({"from-round": rounds, "at": now()})
    return pre


def _no_resume_key(cfg: RunConfig) -> None:
    """A new run given ``resume = true`` is refused before any work (a run is continued with
    ``--resume RUN_FOLDER``, which checks its files)."""
    if cfg.results.resume:
        from server.checkpoint import refuse_resume_key  # Flower: only when it is needed

        refuse_resume_key(cfg)


def _quick_check(cfg: RunConfig) -> None:
    """What needs no data read (files, folders, embedded MNIST's size), said at once:
    before any child process imports torch."""
    from tasks.data_sources import quick_check

    d = cfg.data
    quick_check(d.dataset, d.data_dir, d.download, cfg.federation.num_clients)


def _checked(cfg: RunConfig, echo: Echo, env: dict[str, str] | None = None,
             checker: Checker | None = None) -> Preflight:
    """The pre-flight check (before any run starts: bad data is bad input), in the
    in-process runtime's waiting child (``checker``) or a child of its own; ``env`` names
    the in-process runtime's shared privacy values, which it leaves there."""
    _quick_check(cfg)
    pre = preflight_isolated(cfg, env, checker)
    echo(f"checked: {pre.dataset}; model {pre.model} ({pre.parameters:,} parameters); client "
         f"sizes {min(pre.sizes)}–{max(pre.sizes)}")
    if pre.privacy:
        echo(f"privacy: {pre.privacy}")
    return pre


MAX_RESTARTS = 3  # simulation restarts after dead Ray workers, per run


def _launch(cfg: RunConfig, run_dir: Path, pre: Preflight, supernodes: bool, verbose: bool,
            echo: Echo, inprocess: InProcessLink) -> Result:
    """Run ``cfg`` into ``run_dir``; when a simulated client's Ray worker dies
    (:class:`strategies.rounds.WorkerLost`), restart the simulation from the last
    checkpoint, up to :data:`MAX_RESTARTS` times. An interrupt names ``run_dir`` (the
    folder exists from here on, whatever step it lands in)."""
    try:
        return _launch_attempts(cfg, run_dir, pre, supernodes, verbose, echo, inprocess)
    except KeyboardInterrupt as exc:
        if getattr(exc, "run_dir", None) is None:
            exc.run_dir = run_dir  # type: ignore[attr-defined]
        raise


def _launch_attempts(cfg: RunConfig, run_dir: Path, pre: Preflight, supernodes: bool,
                     verbose: bool, echo: Echo, inprocess: InProcessLink) -> Result:
    for attempt in range(MAX_RESTARTS + 1):
        outcome = _once(cfg, run_dir, pre, supernodes, verbose, echo, inprocess)
        lost = outcome.status == "failed" and "WorkerLost" in (outcome.error or "")
        if not lost or attempt == MAX_RESTARTS:
            break
        from server.checkpoint import FOLDER as CHECKPOINT  # Flower: only when needed
        from server.checkpoint import SERVER_FILE, Checkpoint, cannot_resume

        if not (run_dir / CHECKPOINT / SERVER_FILE).is_file():
            break
        why = cannot_resume(cfg, read_run_info(run_dir))
        if why is not None:  # what --resume would refuse, an automatic restart does not do
            echo(f"{outcome.error.removeprefix('WorkerLost: ')}; not restarting the "
                 f"simulation: {why}")
            break
        rounds = Checkpoint.load(run_dir).round
        echo(f"{outcome.error.removeprefix('WorkerLost: ')}; restarting the simulation from "
             f"the checkpoint of round {rounds} ({attempt + 1}/{MAX_RESTARTS})")
        RunFolder(run_dir).reopen({"from-round": rounds, "at": now(), "automatic": True})
        cfg = validate({**cfg.flat(), "run-dir": str(run_dir), "resume": True})
    return _result(run_dir, cfg, outcome)


def _result(run_dir: Path, cfg: RunConfig, outcome: RunOutcome) -> Result:
    """What the run wrote, read back as :func:`load` reads it: the saved config (with its
    run-dir and run-id), or the config it was given when the ServerApp died before
    writing config.toml."""
    where = f"the run in {run_dir}"
    if (run_dir / "config.toml").is_file():
        cfg = validate(read_saved_config(run_dir, where))
    info = {**outcome.info, "status": outcome.status, "error": outcome.error}
    _check_info(run_dir, info, where)
    return Result(run_dir, cfg, read_ledger(run_dir, where), info)


def _once(cfg: RunConfig, run_dir: Path, pre: Preflight, supernodes: bool, verbose: bool,
          echo: Echo, inprocess: InProcessLink) -> RunOutcome:
    from .runtime.runner import execute
    from .runtime.superlink import LocalSuperLink

    fed = cfg.federation
    runtime = choose(cfg, cuda=pre.cuda, supernodes=supernodes)
    if runtime.name == "inprocess":
        where = ("worker processes" if cfg.resources.client_workers == "processes"
                 else "threads")
        echo(f"in-process runtime ({runtime.why}): the ServerApp and {fed.num_clients} "
             f"ClientApps, a round's clients in {where} beside it, no SuperLink or Ray "
             "(runtime = 'ray' for Flower's simulation runtime)")
        return execute(inprocess, app_dir(), cfg, run_dir, cuda=pre.cuda, verbose=verbose,
                       echo=echo, label_counts=pre.label_counts)
    nodes = fed.num_clients if supernodes else 0
    name = (f"deployment runtime, {nodes} real SuperNodes on loopback" if nodes
            else f"simulation runtime, Ray backend; {runtime.why}")
    echo(f"starting Flower SuperLink ({name})...")
    ray = "" if nodes else cfg.resources.ray_address
    if ray:
        echo(f"the simulated clients run on the Ray cluster at {ray}")
    with LocalSuperLink(supernodes=nodes, ray=ray, plugins=cfg.plugins.plugins) as link:
        up = f"SuperLink and {nodes} SuperNodes" if nodes else "SuperLink"
        echo(f"{up} up on 127.0.0.1:{link.port} in {link.started_s:.1f} s; "
             + ("submitting the run..." if nodes
                else f"starting {fed.num_clients} simulated clients..."))
        return execute(link, app_dir(), cfg, run_dir, cuda=pre.cuda, verbose=verbose,
                       echo=echo, label_counts=pre.label_counts)


def run_deployed(cfg: RunConfig, link: Connection, *, name: str | None = None,
                 verbose: bool = False, echo: Echo | None = print) -> Result:
    """Submit ``cfg`` to a running deployment (``fedpriv deploy superlink``) and wait for
    it; the ServerApp writes the usual results folder on the SuperLink's host (run this
    there, or give a results-dir that exists there)."""
    echo = echo or silent
    _no_resume_key(cfg)
    echo(f"fedpriv deploy run · {link.address} · {cfg.data.dataset} · "
         f"{cfg.federation.num_server_rounds} rounds · seed {cfg.training.seed}")
    given = given_run_dir(cfg.results)
    pre = _checked(cfg, echo)
    run_dir = given or new_run_dir(cfg.results.results_dir, name or default_run_name(cfg))
    return _submit(cfg, link, run_dir, pre, verbose, echo)


def resume_deployed(run_dir: str | Path, link: Connection, *, verbose: bool = False,
                    echo: Echo | None = print) -> Result:
    """Continue a deployed run (e.g. one Flower marked failed when its SuperLink restarted)
    from its last checkpointed round; every SuperNode must have kept its state
    (``--state-dir``), or the ServerApp refuses before the first round."""
    echo = echo or silent
    path, cfg, rounds = _resumable(run_dir, f"fedpriv deploy run --resume ({link.address})",
                                   echo)
    return _submit(cfg, link, path, _reopen(path, cfg, rounds, echo), verbose, echo)


def _submit(cfg: RunConfig, link: Connection, run_dir: Path, pre: Preflight, verbose: bool,
            echo: Echo) -> Result:
    from .deploy.connection import DeployedSuperLink
    from .runtime.runner import execute

    with DeployedSuperLink(link) as deployed:
        outcome = execute(deployed, app_dir(), cfg, run_dir, cuda=pre.cuda, verbose=verbose,
                          echo=echo, label_counts=pre.label_counts)
    return _result(run_dir, cfg, outcome)


def run(preset: str | None = None, *, name: str | None = None, supernodes: bool = False,
        verbose: bool = False, echo: Echo | None = print, **overrides: Any) -> Result:
    """Run a preset (a bundled name such as ``"mnist"`` or a TOML file; None: the
    defaults) with keys overridden, e.g. ``run(num_clients=10, dp="local")``; every
    argument is checked (ConfigError) before anything starts."""
    preset, name = arg.preset("run", preset), arg.name("run", name, None)
    supernodes = arg.flag("run", "supernodes", supernodes)
    verbose = arg.flag("run", "verbose", verbose)
    echo = arg.echo("run", echo)
    try:
        return _run_config(resolve(preset, (), arg.run_keys("run", overrides)), name=name,
                           supernodes=supernodes, verbose=verbose, echo=echo)
    except KeyboardInterrupt as exc:
        raise _interrupted(exc) from None


def _with_keys(doc: str | None) -> str:
    """A docstring followed by every run-config key (``help(fedpriv.run)`` lists them)."""
    from .cli.keys import keys_reference

    return ((doc or "") + "\n\n    Run-config keys (keyword arguments, ``_`` for ``-``; "
            "docs/CONFIG.md):\n" + keys_reference(width=88).replace("\n", "\n    "))


run.__doc__ = _with_keys(run.__doc__)


@dataclass
class SweepResult:
    """A sweep's folder (sweep.csv, sweep.md, plots/) and each cell's run."""

    folder: Path | None
    cells: list[dict[str, Any]]  # index, params, seed, status, error
    runs: dict[int, Result]  # by cell index, for the cells that ran

    @property
    def ok(self) -> bool:
        return all(c["status"] == "finished" for c in self.cells)

    def table(self) -> pandas.DataFrame:
        """sweep.csv as a pandas DataFrame, one row per cell (final and best accuracy,
        epsilon, leakage scores...), each cell's settings as it ran them (a key the cell
        got from the sweep's fixed keys included; one its mode never reads empty)."""
        import pandas as pd

        from .sweep.table import read_table

        if self.folder is None:
            raise ConfigError("SweepResult.table: a dry run (dry_run=True) has no results; "
                              "run the sweep without dry_run to get its table.")
        read_table(self.folder, f"fedpriv.load_sweep({str(self.folder)!r})")  # checked
        return pd.read_csv(self.folder / "sweep.csv", keep_default_na=False,
                           na_values=[""]).set_index("cell")

    def frame(self) -> pandas.DataFrame:
        """Every cell's rounds in one tidy frame (rows: cell x round, round 0 first), with
        ``cell``, ``status`` and a column for every key that differs between cells or from
        the defaults (:func:`concat`)."""

        if not self.runs:
            raise ConfigError(
                f"SweepResult.frame: no cell of the sweep in {self.folder} ran (see its "
                "sweep.md for why); a frame needs at least one cell's rounds." if self.folder
                else "SweepResult.frame: a dry run (dry_run=True) has no results; run the "
                "sweep without dry_run to get its frame.")
        keys = changed(r.config for r in self.runs.values())
        status = {c["index"]: c["status"] for c in self.cells}
        frames = [r.frame(keys) for r in self.runs.values()]
        for (i, _), f in zip(self.runs.items(), frames, strict=True):
            f.insert(0, "cell", i)
            f.insert(1, "status", status.get(i))
        return combine(frames, keys)

    def __repr__(self) -> str:
        done = sum(c["status"] == "finished" for c in self.cells)
        return (f"SweepResult({done} of {len(self.cells)} cells finished, "
                f"{self.folder or 'dry run'})")

    def _repr_html_(self) -> str:
        """In a notebook: the folder, the cells' table (sweep.csv) and the sweep's plots."""
        done = sum(c["status"] == "finished" for c in self.cells)
        head = _rows_html([("sweep", str(self.folder or "dry run")),
                           ("cells", f"{done} of {len(self.cells)} finished")])
        if self.folder is None or not (self.folder / "sweep.csv").is_file():
            return head
        table = self.table().to_html(na_rep="", float_format=lambda v: f"{v:.4g}")
        plots = sorted((self.folder / "plots").glob("*.png"))
        return head + table + "".join(_img(p, p.stem) for p in plots)


def sweep(file: str | None = None, *, grid: Mapping[str, Sequence[Any]] | None = None,
          fixed: Mapping[str, Any] | None = None,
          cells: Sequence[Mapping[str, Any]] | None = None, preset: str | None = None,
          name: str = "python", dry_run: bool = False, verbose: bool = False,
          repeat: int | None = None, separate: bool = False,
          cells_at_once: int | None = None, echo: Echo | None = print,
          **overrides: Any) -> SweepResult:
    """Run every cell of a sweep (a bundled name or a file; or from Python: ``grid`` of
    lists, ``fixed`` keys, extra ``cells``, a base ``preset``) with keys overridden in
    every cell, all inside one simulation (``separate``: one each; ``cells_at_once``:
    how many side by side in it, None for the default), each once per seed with
    ``repeat``; a failed cell is recorded and the sweep goes on. Keys with ``_`` or
    ``-``; progress lines go to ``echo`` (None: none). Every argument is checked
    (ConfigError) before anything starts; a full disk stops the sweep with
    :class:`tasks.files.WriteFailed`, its finished cells kept."""
    given = grid is not None or fixed is not None or cells is not None or preset is not None
    if (file is not None) == given:
        raise ConfigError("fedpriv.sweep takes a sweep file (a bundled name such as "
                          "'dp-epsilon-mnist', or a path) or a sweep given as grid=, fixed=, "
                          "cells= and preset=, not both and not neither. E.g. "
                          "fedpriv.sweep(grid={'dp': ['none', 'local']}, "
                          "fixed={'target_epsilon': 5}).")
    flags = {k: arg.flag("sweep", k, v) for k, v in
             (("dry_run", dry_run), ("verbose", verbose), ("separate", separate))}
    flags["at_once"] = arg.cells_at_once(cells_at_once)
    repeat, values = arg.repeat(repeat), arg.run_keys("sweep", overrides)
    lines = arg.echo("sweep", echo)
    if file is not None:
        source: str | dict[str, Any] = arg.text(
            "sweep", "file", os.fspath(file) if isinstance(file, os.PathLike) else file,
            "a bundled sweep's name such as 'dp-epsilon-mnist' or the path of a sweep file "
            "(text or a pathlib.Path)", "E.g. fedpriv.sweep('dp-epsilon-mnist'); `fedpriv "
            "presets` lists the bundled ones.")
    else:
        table = {"grid": arg.grid(grid) if grid is not None else {},
                 "fixed": arg.run_keys("sweep", fixed, "fixed") if fixed is not None else {},
                 "cells": arg.cells(cells) if cells is not None else []}
        if not table["grid"] and not table["cells"]:
            raise ConfigError("fedpriv.sweep: the sweep has no cells; give grid= (keys to "
                              "lists of values: every combination is a cell) and/or cells= "
                              "(a list of mappings, one per extra cell). E.g. "
                              "fedpriv.sweep(grid={'dp': ['none', 'local']}, "
                              "fixed={'target_epsilon': 5}).")
        source = {"name": arg.name("sweep", name, "python"),
                  **({"preset": arg.preset("sweep", preset)} if preset is not None else {}),
                  **{k: v for k, v in table.items() if v}}
    from .sweep.run import run_sweep
    from .sweep.table import cell_settings

    writer = EchoWriter(lines)
    shown = (contextlib.nullcontext() if lines is print  # print writes to stdout itself
             else contextlib.redirect_stdout(writer))  # made before: writer.outer is stdout
    try:
        with shown:
            done = run_sweep(source, values=values, repeat=repeat, **flags)
    finally:
        writer.finish()
    cells = [{"index": c.index, "params": cell_settings(c, done.keys), "seed": c.seed,
              "status": c.status, "error": c.error} for c in done.cells]
    runs = {c.index: r for c in done.cells if (r := _loaded(c.run_dir)) is not None}
    if done.error is not None:  # a full disk: the cells' folders are kept, and named
        raise done.error
    return SweepResult(done.out, cells, runs)


class EchoWriter(io.TextIOBase):
    """A text stream that hands each complete line to ``echo`` (a sweep's progress, which
    its code prints, sent where the caller asked). While ``echo`` runs, stdout is the
    stream it replaced, so an ``echo`` that prints (``lambda s: print("[sweep]", s)``)
    prints there instead of back into this writer."""

    def __init__(self, echo: Echo) -> None:
        self.echo, self.pending = echo, ""
        self.outer = sys.stdout  # the stream before the redirection

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        *whole, self.pending = self.pending.split("\n")
        for line in whole:
            self._say(line)
        return len(text)

    def _say(self, line: str) -> None:
        inner, sys.stdout = sys.stdout, self.outer
        try:
            self.echo(line)
        finally:
            sys.stdout = inner

    def finish(self) -> None:
        """Hand over a last line that never got its newline."""
        if self.pending:
            self._say(self.pending)
            self.pending = ""


def _loaded(run_dir: Path | None, where: str | None = None) -> Result | None:
    """A cell's run read back, or None when it never wrote its config."""
    if run_dir is None or not (run_dir / "config.toml").exists():
        return None
    return _read(run_dir.resolve(), where or f"fedpriv.load({str(run_dir)!r})")


def load_sweep(folder: str | Path) -> SweepResult:
    """A sweep folder (``results/sweeps/...``), read back: its cells and their runs;
    ConfigError naming the file when sweep.csv or a cell's run is damaged."""
    from .sweep.table import read_table

    path = arg.folder("load_sweep", "folder", folder, "a sweep's folder",
                   "results/sweeps/20261122-101500-dp-epsilon-mnist")
    if not (path / "sweep.csv").is_file():
        raise ConfigError(f"{path} is not a finished fedpriv sweep folder (no sweep.csv). Give "
                          "the folder `fedpriv sweep` printed, e.g. results/sweeps/20261122-"
                          "101500-dp-epsilon-mnist.")
    where = f"fedpriv.load_sweep({str(path)!r})"
    labels, rows = read_table(path, where)
    cells, runs = [], {}
    for row in rows:
        index, run = int(row["cell"]), row["run-dir"]
        result = _loaded(path / run, where) if run else None
        ran = effective(result.config, labels) if result else {}
        params = {k: (ran[k] if result else row[k]) for k in labels
                  if (ran.get(k) is not None if result else row[k])}
        seed = int(row["seed"]) if row.get("seed") else None
        cells.append({"index": index, "params": params, "seed": seed,
                      "status": row["status"], "error": row.get("error") or None})
        if result is not None:
            runs[index] = result
    return SweepResult(path, cells, runs)
