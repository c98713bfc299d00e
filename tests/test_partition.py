import numpy as np
import pytest

from tasks.config import ConfigError, validate
from tasks.datasets import load_dataset
from tasks.partition import label_histogram, partition_indices
from tasks.splits import client_split, partitions_for

LABELS = np.repeat(np.arange(10), 400)  # class-sorted, like the embedded MNIST


def _covers_disjoint(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == len(set(allidx.tolist()))
    assert allidx.min() >= 0 and allidx.max() < n


def test_iid_is_balanced_mixed_disjoint_and_seeded():
    parts = partition_indices(LABELS, 10, "iid", num_classes=10, seed=1)
    _covers_disjoint(parts, len(LABELS))
    assert sum(len(p) for p in parts) == len(LABELS)
    assert {len(p) for p in parts} == {400}
    for p in parts:  # every client sees every class, roughly evenly (sorted input!)
        hist = np.bincount(LABELS[p], minlength=10)
        assert hist.min() >= 20 and hist.max() <= 65
    again = partition_indices(LABELS, 10, "iid", num_classes=10, seed=1)
    other = partition_indices(LABELS, 10, "iid", num_classes=10, seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_dirichlet_small_alpha_skews_labels():
    skewed = partition_indices(LABELS, 10, "dirichlet", num_classes=10, alpha=0.1, seed=0,
                               min_size=5)
    mild = partition_indices(LABELS, 10, "dirichlet", num_classes=10, alpha=100.0, seed=0,
                             min_size=5)
    _covers_disjoint(skewed, len(LABELS))

    def top_share(parts):
        return np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts])

    assert top_share(skewed) > 0.5 > 0.2 > top_share(mild)


def test_dirichlet_infeasible_min_size_is_a_config_error():
    with pytest.raises(ConfigError, match="min-partition-size"):
        partition_indices(LABELS[:100], 50, "dirichlet", num_classes=10, alpha=0.05,
                          min_size=10, seed=0)


def test_shard_gives_each_client_two_label_sorted_shards():
    parts = partition_indices(LABELS, 10, "shard", num_classes=10, shards_per_client=2, seed=0)
    _covers_disjoint(parts, len(LABELS))
    for p in parts:
        assert len(p) == 400
        assert len(np.unique(LABELS[p])) <= 2


def test_pathological_gives_exact_class_count():
    parts = partition_indices(LABELS, 10, "pathological", num_classes=10,
                              classes_per_client=3, seed=0)
    for p in parts:
        assert len(np.unique(LABELS[p])) == 3
    with pytest.raises(ConfigError, match="only 10 classes"):
        partition_indices(LABELS, 10, "pathological", num_classes=10, classes_per_client=11)


def test_more_clients_than_examples_is_refused():
    with pytest.raises(ConfigError, match="more than the 40 training examples"):
        partition_indices(LABELS[:40], 41, "iid", num_classes=10)
    with pytest.raises(ConfigError, match="non-empty shards"):
        partition_indices(LABELS[:40], 30, "shard", num_classes=10, shards_per_client=2)


def test_client_split_matches_partition_and_histogram():
    cfg = validate({"num-clients": 4})
    parts = partitions_for(cfg, 4)
    data = load_dataset("mnist")
    split = client_split(cfg, 2, 4)
    assert len(split) == len(parts[2])
    assert split.label_counts() == label_histogram(data.y_train[parts[2]], 10)
    assert split.x.shape == (len(parts[2]), 1, 28, 28)


@pytest.fixture
def cached_partitions():
    """The in-process partition cache, empty before the test and emptied after it (even
    when the test fails), so that no entry read from tmp_path reaches another test."""
    from tasks.partition import cached_partitions

    cached_partitions.cache_clear()
    yield cached_partitions  # pytest runs the rest whether the test passed or failed
    cached_partitions.cache_clear()


def test_partitions_are_cached_on_disk_by_content(tmp_path, monkeypatch, cached_partitions):
    monkeypatch.setenv("FEDPRIV_CACHE", str(tmp_path))
    key = ("mnist", "", False)
    args = dict(scheme="iid", alpha=0.5, min_size=10, shards_per_client=2,
                classes_per_client=2)
    first = cached_partitions(key, 4, seed=1, **args)
    files = list((tmp_path / "partitions").glob("*.npz"))
    assert len(files) == 1
    # The next process reads the file rather than recomputing: prove it by editing it.
    np.savez(files[0], **{f"p{i}": p[:5] for i, p in enumerate(first)})
    cached_partitions.cache_clear()
    again = cached_partitions(key, 4, seed=1, **args)
    assert [len(p) for p in again] == [5] * 4
    cached_partitions(key, 4, seed=2, **args)  # another seed is another file
    assert len(list((tmp_path / "partitions").glob("*.npz"))) == 2
