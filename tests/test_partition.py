import numpy as np
import pytest

from tasks.config import ConfigError, validate
from tasks.datasets import load_dataset
from tasks.partition import LabelsKey, PartitionArgs, label_histogram, partition_indices
from tasks.splits import client_split, partitions_for

LABELS = np.repeat(np.arange(10), 400)  # class-sorted, like the embedded MNIST


def split(labels, n, scheme, *, alpha=0.5, min_size=10, shards_per_client=2,
          classes_per_client=2, seed=42, num_classes=10):
    args = PartitionArgs(scheme, alpha, min_size, shards_per_client, classes_per_client, seed)
    return partition_indices(labels, n, args, num_classes=num_classes)


def _covers_disjoint(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == len(set(allidx.tolist()))
    assert allidx.min() >= 0 and allidx.max() < n


def test_iid_is_balanced_mixed_disjoint_and_seeded():
    parts = split(LABELS, 10, "iid", seed=1)
    _covers_disjoint(parts, len(LABELS))
    assert sum(len(p) for p in parts) == len(LABELS)
    assert {len(p) for p in parts} == {400}
    for p in parts:  # every client sees every class, roughly evenly (sorted input!)
        hist = np.bincount(LABELS[p], minlength=10)
        assert hist.min() >= 20 and hist.max() <= 65
    again = split(LABELS, 10, "iid", seed=1)
    other = split(LABELS, 10, "iid", seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_dirichlet_small_alpha_skews_labels():
    skewed = split(LABELS, 10, "dirichlet", alpha=0.1, seed=0,
                               min_size=5)
    mild = split(LABELS, 10, "dirichlet", alpha=100.0, seed=0,
                             min_size=5)
    _covers_disjoint(skewed, len(LABELS))

    def top_share(parts):
        return np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts])

    assert top_share(skewed) > 0.5 > 0.2 > top_share(mild)


def test_dirichlet_infeasible_min_size_is_a_config_error():
    with pytest.raises(ConfigError, match="min-partition-size"):
        split(LABELS[:100], 50, "dirichlet", alpha=0.05,
                          min_size=10, seed=0)


def test_shard_gives_each_client_two_label_sorted_shards():
    parts = split(LABELS, 10, "shard", shards_per_client=2, seed=0)
    _covers_disjoint(parts, len(LABELS))
    for p in parts:
        assert len(p) == 400
        assert len(np.unique(LABELS[p])) <= 2


def test_pathological_gives_exact_class_count():
    parts = split(LABELS, 10, "pathological", classes_per_client=3, seed=0)
    for p in parts:
        assert len(np.unique(LABELS[p])) == 3
    with pytest.raises(ConfigError, match="only 10 classes"):
        split(LABELS, 10, "pathological", classes_per_client=11)


def test_more_clients_than_examples_is_refused():
    with pytest.raises(ConfigError, match="more than the 40 training examples"):
        split(LABELS[:40], 41, "iid")
    with pytest.raises(ConfigError, match="non-empty shards"):
        split(LABELS[:40], 30, "shard", shards_per_client=2)


def test_client_split_matches_partition_and_histogram():
    cfg = validate({"num-clients": 4})
    parts = partitions_for(cfg, 4)
    data = load_dataset("mnist")
    held = client_split(cfg, 2, 4)
    assert len(held) == len(parts[2])
    assert held.label_counts() == label_histogram(data.y_train[parts[2]], 10)
    assert held.x.shape == (len(parts[2]), 1, 28, 28)


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
    labels = LabelsKey(LABELS)
    args = PartitionArgs("iid", 0.5, 10, 2, 2, seed=1)
    first = cached_partitions(labels, 10, 4, args)
    files = list((tmp_path / "partitions").glob("*.npz"))
    assert len(files) == 1
    # The next process reads the file rather than recomputing: prove it by editing it.
    np.savez(files[0], **{f"p{i}": p[:5] for i, p in enumerate(first)})
    cached_partitions.cache_clear()
    again = cached_partitions(labels, 10, 4, args)
    assert [len(p) for p in again] == [5] * 4
    cached_partitions(labels, 10, 4, PartitionArgs("iid", 0.5, 10, 2, 2, seed=2))
    assert len(list((tmp_path / "partitions").glob("*.npz"))) == 2  # another seed, another file
    cached_partitions(LabelsKey(LABELS[::-1].copy()), 10, 4, args)
    assert len(list((tmp_path / "partitions").glob("*.npz"))) == 3  # other labels, another file


def test_a_change_to_the_partition_code_invalidates_its_cache(tmp_path, monkeypatch,
                                                              cached_partitions):
    """The cache key holds a digest of tasks/partition.py: edited code recomputes."""
    from tasks import cache

    monkeypatch.setenv("FEDPRIV_CACHE", str(tmp_path))
    labels, args = LabelsKey(LABELS), PartitionArgs("iid", 0.5, 10, 2, 2, seed=1)
    cached_partitions(labels, 10, 4, args)
    cache.code_version.cache_clear()
    real = cache.code_version.__wrapped__
    monkeypatch.setattr(cache, "code_version", lambda modules: real(modules) + "-edited")
    cached_partitions.cache_clear()
    cached_partitions(labels, 10, 4, args)
    assert len(list((tmp_path / "partitions").glob("*.npz"))) == 2
