import numpy as np
import pytest
import torch

from tasks.config import ConfigError
from tasks.datasets import load_dataset

from .conftest import write_cifar_batch, write_cifar_meta, write_mnist_like


@pytest.fixture(autouse=True)
def _fresh_cache():
    load_dataset.cache_clear()
    yield
    load_dataset.cache_clear()


@pytest.mark.parametrize("compress", [False, True])
def test_full_mnist_from_torchvision_layout(tmp_path, compress):
    arrays = write_mnist_like(tmp_path / "MNIST" / "raw", 50, 20, compress=compress)
    data = load_dataset("mnist", str(tmp_path))
    assert data.source.startswith("full MNIST from")
    np.testing.assert_array_equal(data.x_train, arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(data.y_test, arrays["t10k-labels-idx1-ubyte"])
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10


def test_embedded_mnist_fallback_says_so_and_holds_out_a_fixed_test_set(tmp_path):
    data = load_dataset("mnist", str(tmp_path))  # an empty data-dir
    assert "embedded MNIST subset" in data.source and "not found in" in data.source
    assert len(data.y_train) == 4000 and len(data.y_test) == 1000
    assert np.bincount(data.y_test).tolist() == [100] * 10
    # no test digit is also a training digit
    train_rows = {row.tobytes() for row in data.x_train}
    assert not any(row.tobytes() in train_rows for row in data.x_test)
    again = load_dataset.__wrapped__("mnist", "")
    np.testing.assert_array_equal(again.x_test, data.x_test)


def test_fashion_mnist_from_torchvision_layout(tmp_path):
    arrays = write_mnist_like(tmp_path / "FashionMNIST" / "raw", 30, 10, seed=3, compress=True)
    data = load_dataset("fashion-mnist", str(tmp_path))
    np.testing.assert_array_equal(data.x_test, arrays["t10k-images-idx3-ubyte"])
    assert str(tmp_path) in data.source


def test_corrupt_or_truncated_idx_files_are_explained(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    write_mnist_like(raw, 50, 20)
    labels = raw / "train-labels-idx1-ubyte"
    labels.write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)  # not an IDX header
    with pytest.raises(ConfigError, match="malformed"):
        load_dataset("mnist", str(tmp_path))
    load_dataset.cache_clear()
    gz = tmp_path / "g" / "MNIST" / "raw"
    write_mnist_like(gz, 50, 20, compress=True)
    path = gz / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        load_dataset("mnist", str(tmp_path / "g"))


@pytest.fixture
def synthetic_cifar(monkeypatch):
    """torchvision checks CIFAR's files against the real ones' MD5 sums, which synthetic
    files cannot match: only the sum is skipped (a file must still exist), the real
    reader runs."""
    import os

    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))


def _cifar_images(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)


def test_cifar10_pickles(tmp_path, synthetic_cifar):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar_meta(folder / "batches.meta", "label_names", 10)
    batches = []
    for i in range(1, 6):
        imgs, labels = _cifar_images(4, i), np.arange(4) + i
        write_cifar_batch(folder / f"data_batch_{i}", imgs, labels % 10, "labels")
        batches.append((imgs, labels % 10))
    test_imgs = _cifar_images(3, 9)
    write_cifar_batch(folder / "test_batch", test_imgs, np.array([7, 8, 9]), "labels")
    data = load_dataset("cifar10", str(tmp_path))
    assert data.x_train.shape == (20, 32, 32, 3) and data.input_shape == (3, 32, 32)
    # pixel (row r, col c, channel ch) of image 0 is data[ch*1024 + r*32 + c]
    np.testing.assert_array_equal(data.x_train[0], batches[0][0][0].transpose(1, 2, 0))
    np.testing.assert_array_equal(data.y_train[4:8], batches[1][1])
    np.testing.assert_array_equal(data.y_test, [7, 8, 9])
    t = data.to_tensor(data.x_test)
    assert t.shape == (3, 3, 32, 32) and t.dtype == torch.float32
    expected = (test_imgs[1, 2, 5, 6] / 255 - data.mean[2]) / data.std[2]
    assert t[1, 2, 5, 6].item() == pytest.approx(expected, rel=1e-5)


def test_cifar100_pickles_use_fine_labels(tmp_path, synthetic_cifar):
    folder = tmp_path / "cifar-100-python"
    write_cifar_meta(folder / "meta", "fine_label_names", 100)
    write_cifar_batch(folder / "train", _cifar_images(6, 1), np.array([0, 99, 5, 6, 7, 8]),
                      "fine_labels")
    write_cifar_batch(folder / "test", _cifar_images(2, 2), np.array([42, 43]), "fine_labels")
    data = load_dataset("cifar100", str(tmp_path))
    assert data.num_classes == 100 and data.y_train.tolist() == [0, 99, 5, 6, 7, 8]


def test_cifar_missing_names_expected_files(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        load_dataset("cifar10", str(tmp_path))
    text = str(err.value)
    assert "data_batch_2" in text and "test_batch" in text and "download = true" in text
    assert "data_batch_1," not in text.split("Expected")[0]  # present files are not "missing"


def test_cifar_without_data_dir_explains_layout():
    with pytest.raises(ConfigError, match="cifar-100-python"):
        load_dataset("cifar100", "")


def test_corrupt_cifar_files_fail_torchvisions_checksum(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        write_cifar_batch(folder / name, _cifar_images(2, 0), np.array([1, 2]), "labels")
    write_cifar_meta(folder / "batches.meta", "label_names", 10)
    with pytest.raises(ConfigError, match="missing, truncated or corrupt"):
        load_dataset("cifar10", str(tmp_path))


def test_missing_data_dir_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_dataset("mnist", str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        load_dataset("mnist", str(tmp_path / "file"))


def test_download_needs_a_data_dir():
    with pytest.raises(ConfigError, match="needs a data-dir"):
        load_dataset("mnist", "", True)


def test_breast_cancer_is_standardized_on_train_only():
    data = load_dataset("breast-cancer")
    assert data.x_train.shape == (455, 30) and data.x_test.shape == (114, 30)
    np.testing.assert_allclose(data.x_train.mean(0), 0, atol=1e-5)
    assert abs(float(data.x_test.mean())) > 1e-4  # test rows were not used for the scaler
    assert data.input_shape == (30,) and data.kind == "tabular"


def test_image_tensor_layout_and_normalization():
    data = load_dataset("mnist")
    t = data.to_tensor(data.x_train[:500])
    assert t.shape == (500, 1, 28, 28)
    assert abs(t.mean().item()) < 0.15 and 0.8 < t.std().item() < 1.2
