"""Simulated nodes serve the partition the server assigns, and a sweep's cells share warm
clients without sharing state: the real ServerApp code and the real ClientApp, in-process."""

from __future__ import annotations

import json

from flwr.app import Context, RecordDict

from server.app import run_cells
from server.federation import run_federation
from tasks.config import validate
from tasks.results.folder import RunFolder
from tasks.results.ledger import read_ledger

from .inprocess import InProcessGrid
from .test_strategies import _task_identity  # noqa: F401  (fixture)

BASE = {"num-clients": 4, "num-server-rounds": 2, "fraction-train": 0.25, "dp": "local",
        "noise-multiplier": 1.0, "batch-size": 64, "save-model": False}


def _server_context(cfg):
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                   run_config=cfg.flat())


def _run(grid, cfg, path):
    run = RunFolder(path)
    run_federation(grid, _server_context(cfg), cfg, run)
    return read_ledger(path)


def test_simulated_nodes_serve_the_partition_the_server_assigns(tmp_path):
    cfg = validate(BASE)
    # Each node's own node_config names the opposite partition of the one the server
    # assigns (sorted ids: 3000 -> 0, ..., 3003 -> 3): only the assignment can match.
    grid = InProcessGrid(cfg, node_ids=[3003, 3002, 3001, 3000], simulated=True)
    assert grid.partition_of == {3003: 0, 3002: 1, 3001: 2, 3000: 3}
    ledger = _run(grid, cfg, tmp_path / "assigned")
    parts = json.loads((tmp_path / "assigned" / "partitions.json").read_text())["clients"]
    assert [(p["node-id"], p["partition-id"]) for p in parts] == [
        (3000, 0), (3001, 1), (3002, 2), (3003, 3)]
    for r in ledger:  # one client a round: the one sampled is the one that trained
        assert len(r.sampled) == 1 and [c["partition-id"] for c in r.clients] == r.sampled
    assert all("fedpriv.node" not in m.content for m in grid.sent)  # removed on arrival
    # the same seed samples and trains exactly as nodes that hold their partitions
    same = _run(InProcessGrid(cfg), cfg, tmp_path / "discovered")
    assert [r.test for r in ledger] == [r.test for r in same]
    assert [r.privacy for r in ledger] == [r.privacy for r in same]


def test_sweep_cells_share_warm_clients_but_not_their_state(tmp_path):
    host = validate({**BASE, "fraction-train": 1.0})
    cells = [{**BASE, "fraction-train": 1.0, "num-clients": 3},
             {**BASE, "fraction-train": 1.0, "noise-multiplier": 2.0}]
    plan = {"cells": [{"index": i, "label": f"cell {i}",
                       "config": {**validate(c).flat(), "run-dir": str(tmp_path / f"c{i}")}}
                      for i, c in enumerate(cells, 1)]}
    (tmp_path / "cells.json").write_text(json.dumps(plan))
    grid = InProcessGrid(host, simulated=True)
    run_cells(grid, _server_context(host), tmp_path / "cells.json")
    # each cell equals a run of that cell alone, on fresh clients
    for i, values in enumerate(cells, 1):
        cfg = validate(values)
        alone = _run(InProcessGrid(cfg, simulated=True), cfg, tmp_path / f"alone{i}")
        together = read_ledger(tmp_path / f"c{i}")
        assert [r.test for r in together] == [r.test for r in alone]
        assert [r.privacy for r in together] == [r.privacy for r in alone]
        assert [sorted(r.sampled) for r in together] == [list(range(cfg.federation.num_clients))
                                                         ] * 2
    # cell 1 ran on 3 of the 4 nodes; each cell's DP ledger is kept under its own prefix
    states = {nid: sorted(c.state) for nid, c in grid.contexts.items()}
    assert sum(any(k.startswith("cell-1/") for k in v) for v in states.values()) == 3
    assert all(any(k.startswith("cell-2/") for k in v) for v in states.values())
    assert all(not any("/" not in k for k in v) for v in states.values())
