"""The GPU check: each workload whose purpose is a GPU, timed on the CUDA device beside the
same workload on the CPU and the plain PyTorch loop on the GPU, in one run.

Workloads (each an existing benchmark, run as a child with ``--json``):

* the main job (10 clients, 5 rounds): fedpriv's steady round against the plain loop, as
  it runs by default and with ``train-together`` (the round's clients as one batched
  program);
* DP-SGD: one client's local epoch, book-keeping clipping, against plain SGD's epoch, on
  the MNIST default's small CNN and on the language task's char-GRU (its recurrence
  stepped in Python, 80 steps of small matrix products a pass: launch-bound on a GPU);
* ``train-together``: a round's 10, 100 and 1,000 clients as one ``torch.func`` program
  against the same clients trained one after another (the plain loop);
* the attacks' reference training: 16 reference updates together against the loop.

On a machine without a CUDA device it says so and stops (exit 0): nothing here needs one.
``--device cpu`` runs the whole check with the CPU standing in for the GPU (what the
tests do, with ``--quick``'s small sizes), so the script is known to work before a GPU
is lent.

    python -m experiments.benchmarks.gpu_check                # on a machine with a GPU
    python -m experiments.benchmarks.gpu_check --skip-cpu     # GPU figures only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Workload:
    """One benchmark: its module, its arguments for a device, and how to read its JSON
    into rows of (what, fedpriv seconds, plain-loop seconds)."""

    name: str
    module: str
    args: Callable[[str, bool], list[str]]
    rows: Callable[[dict | list], list[tuple[str, float, float]]]


def _main_job_args(*extra: str) -> Callable[[str, bool], list[str]]:
    def args(device: str, quick: bool) -> list[str]:
        # one client on the whole GPU at a time: the in-process runtime, as the plain loop
        # trains (shares of a GPU would take the Ray runtime)
        sets = ["num-clients=2", "num-server-rounds=2"] if quick else []
        return [a for s in [f"device={device}", "client-gpus=1", *extra, *sets]
                for a in ("--set", s)]
    return args


def _main_job_rows(label: str) -> Callable[[dict], list[tuple[str, float, float]]]:
    def rows(report: dict) -> list[tuple[str, float, float]]:
        fp, pl = report["fedpriv"], report["plain"]
        return [(f"{label}, steady round", fp["steady-round-s"], pl["steady-round-s"]),
                (f"{label}, whole run", fp["total-s"], pl["total-s"])]
    return rows


def _dp_args(device: str, quick: bool) -> list[str]:
    return ["--skip-federated", "--set", f"device={device}", "--repeats",
            "1" if quick else "5"]


def _text_dp_args(device: str, quick: bool) -> list[str]:
    return ["--config", "shakespeare", "--skip-federated", "--set", f"device={device}",
            "--repeats", "1" if quick else "3", *(["--set", "local-steps=2"] if quick else [])]


def _dp_rows(label: str) -> Callable[[dict], list[tuple[str, float, float]]]:
    def rows(report: dict) -> list[tuple[str, float, float]]:
        epoch = report["epoch-s"]
        return [(f"{label} client epoch, {mode}", seconds, epoch["none"])
                for mode, seconds in epoch.items() if mode in ("bookkeeping", "hooks")]
    return rows


def _together_args(device: str, quick: bool) -> list[str]:
    sizes = ["--clients", "2", "4", "--images", "8", "--repeats", "1"] if quick else \
        ["--clients", "10", "100", "1000", "--images", "40", "--repeats", "3"]
    return ["--device", device, *sizes]


def _together_rows(report: list) -> list[tuple[str, float, float]]:
    return [(f"train-together, {r['clients']} clients x {r['images']} images",
             r["together"], r["sequential"]) for r in report]


def _references_args(device: str, quick: bool) -> list[str]:
    return ["--device", device, "--references", "2" if quick else "16"]


def _references_rows(report: dict) -> list[tuple[str, float, float]]:
    return [(f"reference training, {what}", report[f"{what}-together-s"],
             report[f"{what}-loop-s"]) for what in ("SGD", "DP-SGD")]


WORKLOADS = (
    Workload("main job", "fedavg_overhead", _main_job_args(), _main_job_rows("main job")),
    # a round's clients as one batched program inside the whole run (what a GPU is for)
    Workload("main job, train-together", "fedavg_overhead", _main_job_args("train-together=true"),
             _main_job_rows("main job with train-together")),
    Workload("DP-SGD", "dp_overhead", _dp_args, _dp_rows("DP-SGD")),
    Workload("DP-SGD, char-GRU", "dp_overhead", _text_dp_args, _dp_rows("DP-SGD char-GRU")),
    Workload("train-together", "cohort_training", _together_args, _together_rows),
    Workload("reference training", "reference_training", _references_args,
             _references_rows),
)


def run_workload(w: Workload, device: str, quick: bool, timeout: float
                 ) -> list[tuple[str, float, float]]:
    """Run one benchmark as a child on ``device``; its rows (an error raises)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [sys.executable, "-m", f"experiments.benchmarks.{w.module}",
               *w.args(device, quick), "--json", str(out)]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.is_file():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"{' '.join(cmd[2:])} failed (exit {done.returncode}):\n{tail}")
        return w.rows(json.loads(out.read_text()))


def describe(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return "the CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="the device under test (cpu: the CPU stands in, to try the "
                             "script where there is no GPU)")
    parser.add_argument("--skip-cpu", action="store_true",
                        help="leave out the CPU column (the CPU figures are in "
                             "docs/BENCHMARKS.md)")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--only", nargs="+", choices=[w.name for w in WORKLOADS],
                        help="run these workloads only")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds allowed to each benchmark on each device")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        build = (f"built for CUDA {torch.version.cuda}" if torch.version.cuda
                 else "a CPU-only build")
        print(f"No CUDA device on this machine (torch {torch.__version__}, {build}): the "
              "GPU check has nothing to measure. Run it on a machine with a GPU; the CPU "
              "figures are in docs/BENCHMARKS.md, and `--device cpu` tries this script "
              "here with the CPU standing in.", flush=True)
        return 0
    print(f"GPU check on {describe(args.device)}; CPU column "
          f"{'left out' if args.skip_cpu else 'measured in the same run'}", flush=True)
    figures: list[dict] = []
    failed = []
    for w in WORKLOADS:
        if args.only and w.name not in args.only:
            continue
        try:
            start = time.perf_counter()
            print(f"{w.name} on {args.device} ...", flush=True)
            on_device = run_workload(w, args.device, args.quick, args.timeout)
            on_cpu = ([] if args.skip_cpu or args.device == "cpu" else
                      run_workload(w, "cpu", args.quick, args.timeout))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"  {w.name}: {e}", flush=True)
            failed.append(w.name)
            continue
        cpu = {what: seconds for what, seconds, _ in on_cpu}
        rows = [{"workload": what, "device-s": seconds, "plain-loop-s": plain,
                 "cpu-s": cpu.get(what)} for what, seconds, plain in on_device]
        figures += rows
        for f in rows:  # as each workload ends: a run cut short keeps what it measured
            print(f"  {f['workload']}: {f['device-s']:.3f} s, plain loop "
                  f"{f['plain-loop-s']:.3f} s", flush=True)
        print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
        _save(args.json, args.device, figures, failed)
    _print_table(figures, args.device)
    _save(args.json, args.device, figures, failed)
    return 1 if failed else 0


def _save(path: Path | None, device: str, figures: list[dict], failed: list[str]) -> None:
    if path:
        path.write_text(json.dumps({"device": describe(device), "figures": figures,
                                    "failed": failed}, indent=2))


def _print_table(figures: list[dict], device: str) -> None:
    with_cpu = device != "cpu" and any(f["cpu-s"] is not None for f in figures)
    head = ("workload", f"{device} (s)", f"plain loop on {device} (s)", "ratio to the loop",
            *(("cpu (s)", f"{device} vs cpu") if with_cpu else ()))
    rows = [head]
    for f in figures:
        cpu = f["cpu-s"]
        cpu_cols = ("" if cpu is None else f"{cpu:.3f}",
                    "" if cpu is None else f"{f['device-s'] / cpu:.2f}x")
        rows.append((f["workload"], f"{f['device-s']:.3f}", f"{f['plain-loop-s']:.3f}",
                     f"{f['device-s'] / f['plain-loop-s']:.2f}x",
                     *(cpu_cols if with_cpu else ())))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    sys.exit(main())
