"""Benchmark: round time and bytes on the wire per client for plain FedAvg, SecAgg+ and
CKKS homomorphic encryption, on the small CNN and the McMahan CNN.

The real ServerApp and ClientApp code run in one process (tests/inprocess.py: no Ray,
so the figures are the protocols' own cost, not the runtime's). Every message a client
sends is serialized as Flower serializes it (its RecordDict protobuf) and counted; a
round's bytes are everything one client sends the server in it (SecAgg+: its keys,
shares and masked vector; HE: its ciphertexts, and for the decrypting client the sum).
Plain FedAvg is the baseline the ratios are against, measured in the same run.

    python -m experiments.benchmarks.he_aggregation
    python -m experiments.benchmarks.he_aggregation --clients 5 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from flwr.app import Context, RecordDict
from flwr.common.serde import recorddict_to_proto
from flwr.supercore.task_identity import TaskIdentity

from server.app import run_one
from tasks.config import validate
from tasks.results.ledger import read_ledger

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.inprocess import InProcessGrid  # noqa: E402  (the in-process federation)


class Counting(InProcessGrid):
    """Counts the serialized bytes each client sends, per round."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.sent_bytes: dict[int, int] = defaultdict(int)  # node -> bytes, this round

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        for reply in replies:
            self.sent_bytes[reply.metadata.src_node_id] += \
                recorddict_to_proto(reply.content).ByteSize()
        return replies


def _one(model: str, protocol: str, clients: int, rounds: int, tmp: Path) -> dict:
    cfg = validate({"num-clients": clients, "num-server-rounds": rounds, "model": model,
                    "secure-aggregation": protocol, "local-epochs": 1, "batch-size": 64,
                    "save-model": False, "run-dir": str(tmp / f"{model}-{protocol}")})
    grid = Counting(cfg, simulated=True)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=cfg.flat())
    t0 = time.perf_counter()
    run_one(grid, context, cfg)
    wall = time.perf_counter() - t0
    ledger = read_ledger(tmp / f"{model}-{protocol}")
    steady = [r.time["round-s"] for r in ledger[1:]] or [ledger[0].time["round-s"]]
    return {"wall": wall, "round": statistics.mean(steady),
            "bytes": sum(grid.sent_bytes.values()) / clients / rounds,
            "accuracy": ledger[-1].accuracy}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="small-cnn,cnn")
    args = ap.parse_args(argv)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            base = None
            for protocol in ("off", "secagg+", "he"):
                print(f"running: {model}, secure-aggregation = {protocol}...", flush=True)
                r = _one(model, protocol, args.clients, args.rounds, Path(tmp))
                base = base or r
                rows.append(
                    f"| {model} | {protocol} | {r['round']:.2f} | "
                    f"{r['round'] / base['round']:.2f}x | {r['bytes'] / 1e6:.2f} | "
                    f"{r['bytes'] / base['bytes']:.1f}x | {r['accuracy']:.4f} |")
    print(f"\n{args.clients} clients, {args.rounds} rounds, embedded MNIST; steady round = "
          "rounds 2..R; bytes = what one client sends the server per round")
    print("| model | secure-aggregation | round s | vs plain | MB sent per client per round "
          "| vs plain | final acc |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
