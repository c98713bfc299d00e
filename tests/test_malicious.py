"""A malicious server's trap weights: records fall out of the *aggregate* of 8
clients' updates verbatim, through SecAgg+ in a real federation; local DP-SGD stops it; a
client screen stops the published trap and not a disguised one. The clients train as
PyTorch (and Opacus, for DP-SGD) train; the attack reads only the summed update."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from privacy.attacks.imprint import recover, trap_weights
from tasks.datasets import load_dataset
from tasks.models import mlp_net

from .test_strategies import _task_identity  # noqa: F401  (fixture)

CLIENTS, BATCH, MEAN, STD = 8, 32, 0.1307, 0.3081


def _cohort_update(width: int, dp_sigma: float | None, disguise: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cohort's images, what the attack recovers from the mean of their updates)."""
    torch.manual_seed(0)
    data = load_dataset("mnist")
    x, y = data.to_tensor(data.x_train[:1500]), torch.from_numpy(data.y_train[:1500])
    model = mlp_net(784, (width, 64), 10)
    honest = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sent, trap = trap_weights(model, honest, x[CLIENTS * BATCH:],  # server's own rows
                              disguise=disguise)
    total = {k: torch.zeros_like(v) for k, v in sent.items()}
    for c in range(CLIENTS):  # one local step on a batch of 32, as FedAvg's clients do
        xb, yb = x[c * BATCH:(c + 1) * BATCH], y[c * BATCH:(c + 1) * BATCH]
        local = mlp_net(784, (width, 64), 10)
        local.load_state_dict(sent)
        opt = torch.optim.SGD(local.parameters(), lr=0.05)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xb, yb),
                                             batch_size=BATCH)
        if dp_sigma is not None:
            from opacus import PrivacyEngine

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                local, opt, loader = PrivacyEngine().make_private(
                    module=local, optimizer=opt, data_loader=loader,
                    noise_multiplier=dp_sigma, max_grad_norm=1.0, poisson_sampling=False)
        for xs, ys in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(local(xs), ys).backward()
            opt.step()
        state = {k.removeprefix("_module."): v for k, v in local.state_dict().items()}
        for k in total:
            total[k] += state[k] - sent[k]
    return x[:CLIENTS * BATCH], recover({k: v / CLIENTS for k, v in total.items()}, trap)


def _recovered_share(originals: torch.Tensor, found: torch.Tensor, db: float = 30.0) -> float:
    """Share of the originals that some recovered row matches above ``db`` PSNR (pixels)."""
    if not len(found):
        return 0.0
    a = (originals.reshape(len(originals), -1) * STD + MEAN).clamp(0, 1)
    b = (found * STD + MEAN).clamp(0, 1)
    mse = ((a[:, None, :] - b[None, :, :]) ** 2).mean(-1).clamp(min=1e-10)
    return float(((-10 * torch.log10(mse)).max(1).values > db).double().mean())


def test_trap_weights_recover_most_of_a_cohorts_images_from_the_aggregate():
    originals, found = _cohort_update(1024, None)
    assert _recovered_share(originals, found) > 0.45  # 256 images through the sum of 8
    narrow_originals, narrow = _cohort_update(200, None)
    assert _recovered_share(narrow_originals, narrow) < 0.3  # 200 bins for 256 images


def test_local_dp_sgd_stops_the_trap_and_it_is_the_noise_not_the_clipping():
    originals, found = _cohort_update(1024, 1.0)
    assert _recovered_share(originals, found) < 0.02
    # per-record clipping alone scales each record's gradient, which a bin's ratio cancels
    originals, found = _cohort_update(1024, 0.0)
    assert _recovered_share(originals, found) > 0.45


def test_a_model_without_a_trap_layer_is_refused_before_anything_runs():
    from experiments.preflight.checks import preflight
    from tasks.config import ConfigError, validate

    cfg = validate({"model": "resnet18", "server": "malicious", "reference-fraction": 0.1,
                    "leakage-rounds": "1", "leakage-clients": "aggregate",
                    "attacks": "imprint", "num-clients": 2})
    with pytest.raises(ConfigError, match="resnet18.*cannot be tampered with that way"):
        preflight(cfg)


def test_a_model_without_two_linear_layers_is_refused():
    conv = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(2704, 10))
    with pytest.raises(ValueError, match="followed by a ReLU and another linear layer"):
        trap_weights(conv, conv.state_dict(), torch.zeros(4, 1, 28, 28))


def test_a_malicious_run_reads_the_cohorts_records_out_of_the_aggregate(tmp_path):
    import json

    from experiments.leakage.attack import run_attacks
    from tasks.results.ledger import read_ledger

    from .test_leakage import observed_run

    observed_run(tmp_path, {"num-clients": 8, "model": "mlp", "mlp-hidden": "1024,64",
                            "server": "malicious", "reference-fraction": 0.1,
                            "leakage-rounds": "1", "leakage-clients": "aggregate",
                            "attacks": "imprint", "observed-examples": 32,
                            "batch-size": 32}, rounds=2)
    ledger = read_ledger(tmp_path)
    assert [r.tampered for r in ledger] == ["imprint", None]
    initial = json.loads((tmp_path / "run.json").read_text())["initial"]
    assert ledger[0].test == initial  # the tampered round's result was thrown away
    summary = run_attacks(tmp_path, echo=lambda line: None)["imprint"]
    assert summary["recovered-above-30db"] > 0.45  # of the 8 x 32 records
    # labels from each bin's bias scale: the class whose loss gradient explains it
    assert summary["label-accuracy-recovered"] > 0.9


@pytest.mark.parametrize("values, why", [
    ({"features": "embeddings"}, "a frozen backbone's outputs"),
    ({"reference-fraction": 0.0}, "reference-fraction = 0 keeps none"),
    ({"leakage-rounds": ""}, "tampers only with observed rounds"),
    ({"strategy": "fedadam"}, "strategy = 'fedavg'"),
], ids=["embeddings", "no-own-data", "unobserved", "fedadam"])
def test_malicious_settings_that_cannot_work_are_refused_before_anything_runs(values, why):
    from tasks.config import ConfigError, validate

    base = {"model": "mlp", "server": "malicious", "reference-fraction": 0.1,
            "leakage-rounds": "1", "leakage-clients": "aggregate", "attacks": "imprint"}
    with pytest.raises(ConfigError, match=why):
        validate({**base, **values})


@pytest.mark.slow
def test_a_deployment_whose_operators_have_not_agreed_is_refused_before_any_round(tmp_path):
    """Real SuperNodes behind TLS and authentication on loopback: host 0 started its
    SuperNode with --accept-trap-weights, host 1 did not. `fedpriv deploy run` with
    server = 'malicious' names host 1, runs no round, and sends no trap weights."""
    import subprocess
    import sys
    import uuid

    from tasks.results.ledger import read_ledger

    from .conftest import REPO, only_run
    from .test_cli import _processes_with
    from .test_deploy import _fedpriv, _free_port, _online, _stop_all, secured_superlink

    marker = uuid.uuid4().hex
    started: list[subprocess.Popen] = []
    deploy = [sys.executable, "-m", "experiments.cli", "deploy"]
    try:
        link, op = secured_superlink(tmp_path, marker, started, keys=2, register=2)
        for i in range(2):
            agree = ["--accept-trap-weights"] if i == 0 else []
            started.append(_fedpriv(
                "deploy", "supernode", *link, "--key", str(tmp_path / "keys" / f"supernode-{i}"),
                "--partition-id", str(i), "--num-partitions", "2", "--port", str(_free_port()),
                *agree, marker=marker, log=tmp_path / f"supernode-{i}.log"))
        _online(op, 2)
        results = tmp_path / "results"
        res = subprocess.run(
            [*deploy, "run", *op, "--set", "num-clients=2", "--set", "model=mlp",
             "--set", "server=malicious", "--set", "reference-fraction=0.1",
             "--set", "leakage-rounds=1", "--set", "leakage-clients=aggregate",
             "--set", "attacks=imprint", "--set", "observed-examples=32",
             "--set", f"results-dir={results}"],
            cwd=REPO, capture_output=True, text=True, timeout=300,
            env={**__import__("os").environ, "FEDPRIV_TEST_MARKER": marker})
        out = res.stdout + res.stderr
        assert res.returncode != 0, out
        assert "operators of client(s) 1 have not agreed to it: no round was run" in out
        assert "--accept-trap-weights" in out and "Traceback" not in out
        folder = only_run(results)
        assert read_ledger(folder) == []  # no round, so no trap was ever sent
        assert not (folder / "observations").exists()
    finally:
        _stop_all(started, marker)
    assert _processes_with(marker) == []


@pytest.mark.slow
def test_a_malicious_server_reads_the_cohort_through_secagg_in_a_real_federation(tmp_path):
    """Flower's simulation runtime with SecAgg+ (real masking and quantization): the
    trap reads most of 8 clients' 256 images out of the secure sum, a client screen
    stops the published trap, the disguised trap passes the screen, and `fedpriv attack`
    reproduces the number from the saved observation."""
    import csv

    from .conftest import run_cli

    results = tmp_path / "results"
    sweep = tmp_path / "malicious.toml"
    sweep.write_text(f"""name = "malicious-test"
preset = "mnist"
[fixed]
num-clients = 8
fraction-train = 1.0
num-server-rounds = 1
model = "mlp"
mlp-hidden = "1024,64"
server = "malicious"
reference-fraction = 0.1
leakage-rounds = "1"
leakage-clients = "aggregate"
attacks = "imprint"
observed-examples = 32
batch-size = 32
secure-aggregation = "secagg+"
results-dir = "{results}"
[[cells]]
client-screen = "none"
[[cells]]
client-screen = "rank-one"
[[cells]]
client-screen = "rank-one"
server-trap = "binning-disguised"
""")
    res = run_cli("sweep", str(sweep), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    out = next((results / "sweeps").iterdir())
    rows = list(csv.DictReader(open(out / "malicious.csv")))
    assert [r["defence"] for r in rows] == ["SecAgg+"] + ["SecAgg+ + client screen "
                                                          "(rank-one)"] * 2
    plain, screened, disguised = rows
    assert float(plain["recovered-above-30db"]) > 0.5 and plain["holds"] == "**NO**"
    assert screened["trained"] == "0" and screened["declined"] == "8"
    assert screened["holds"] == "yes"
    assert float(disguised["recovered-above-30db"]) > 0.5
    assert "8 client(s) sent no update, refused the weights (client-screen)" in res.stdout
    assert (out / "plots" / "malicious_reconstructions.png").is_file()
    summary = (Path(screened["run-dir"]) / "summary.md").read_text()
    assert "**malicious server**: in round(s) 1 the server sent trap weights" in summary
    assert "| 1 (tampered) |" in " ".join(summary.split())  # the table's padding
    assert "client 0: refused the weights (client-screen)" in summary

    run = Path(plain["run-dir"])
    first = json.loads((run / "leakage.jsonl").read_text().splitlines()[0])
    again = run_cli("attack", str(run), cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    second = json.loads((run / "leakage.jsonl").read_text().splitlines()[0])
    for key in ("recovered-above-30db", "psnr", "ssim"):
        assert second[key] == first[key], key


def test_behind_a_cnns_convolutions_the_trap_returns_features_and_they_invert(tmp_path):
    """The McMahan CNN: the server sends an invertible trunk and the trap in the first
    fully-connected layer; the bins give back exact features, which invert to images."""
    from experiments.leakage.attack import run_attacks

    from .test_leakage import observed_run

    observed_run(tmp_path, {"num-clients": 2, "model": "cnn", "server": "malicious",
                            "reference-fraction": 0.1, "leakage-rounds": "1",
                            "leakage-clients": "aggregate", "attacks": "imprint",
                            "observed-examples": 16, "batch-size": 16})
    summary = run_attacks(tmp_path, echo=lambda line: None)["imprint"]
    assert summary["recovered-above-30db"] > 0.6  # of 2 x 16 records, 512 bins
    assert summary["label-accuracy-recovered"] > 0.8
