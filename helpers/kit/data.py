"""Handwritten digits for the lessons: real MNIST when it can be had, shipped digits when not.

    from helpers.kit.data import prepare, load
    prepare()                          # in the notebook, once: downloads MNIST if online
    train_set, source = load(train=True)   # in workers: never downloads

Offline (or with LESSONS_DATA=digits, which the test suite sets so that results are the same on
every machine), the fallback is the UCI "Optical Recognition of Handwritten Digits" test set that
ships in this package (1,797 real handwritten digits, 8x8 pixels, from scikit-learn's copy, CC BY
4.0), upscaled and centred into 28x28 images like MNIST's. Every call says which data it used.
"""
from __future__ import annotations

import gzip
import os
import socket
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from helpers.kit import REPO_ROOT

DATA_ROOT = REPO_ROOT / "data"
_DIGITS_FILE = Path(__file__).resolve().parent / "digits.csv.gz"
MNIST_NAME = "MNIST (torchvision)"
DIGITS_NAME = "UCI handwritten digits shipped with the lessons (offline fallback), 28x28"


def _wanted() -> str:
    choice = os.environ.get("LESSONS_DATA", "auto").lower()
    if choice not in {"auto", "mnist", "digits"}:
        raise ValueError(f"LESSONS_DATA must be auto, mnist or digits, not {choice!r}")
    return choice


def _mnist_present(root: Path) -> bool:
    return (root / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").exists()


def prepare(root: Path = DATA_ROOT, timeout: float = 10.0) -> str:
    """Download MNIST once if allowed and possible; return (and print) which data the lessons use."""
    choice = _wanted()
    if choice != "digits" and not _mnist_present(root):
        from torchvision import datasets

        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(timeout)
        try:
            for train in (True, False):
                datasets.MNIST(root, train=train, download=True)
        except Exception as error:  # offline, blocked, or a mirror is down
            if choice == "mnist":
                raise RuntimeError(f"LESSONS_DATA=mnist but MNIST could not be downloaded into "
                                   f"{root}: {error}. Unset LESSONS_DATA to use the shipped digits.") from error
        finally:
            socket.setdefaulttimeout(previous)
    source = MNIST_NAME if choice != "digits" and _mnist_present(root) else DIGITS_NAME
    print(f"Data for the lessons: {source}")
    return source


def load(train: bool = True, root: Path = DATA_ROOT, limit: int | None = None) -> tuple[TensorDataset, str]:
    """(dataset of (image [1,28,28] in 0..1, label), source name). Never downloads."""
    if _wanted() != "digits" and _mnist_present(root):
        from torchvision import datasets

        mnist = datasets.MNIST(root, train=train, download=False)
        images, labels, source = mnist.data.float().div(255).unsqueeze(1), mnist.targets, MNIST_NAME
    else:
        if _wanted() == "mnist":
            raise FileNotFoundError(f"LESSONS_DATA=mnist but MNIST is not in {root}; run "
                                    f"helpers.kit.data.prepare() in the notebook first")
        images, labels = digits_as_mnist(train)
        source = DIGITS_NAME
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return TensorDataset(images, labels), source


def digits_as_mnist(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The shipped 8x8 digits as 28x28 MNIST-like images; a fixed 80/20 train/test split."""
    with gzip.open(_DIGITS_FILE, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    pixels = torch.from_numpy(table[:, :64]).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.from_numpy(table[:, 64]).long()
    # MNIST centres a 20x20 digit in a 28x28 frame: do the same.
    images = torch.nn.functional.interpolate(pixels, size=(20, 20), mode="bilinear", align_corners=False)
    images = torch.nn.functional.pad(images, (4, 4, 4, 4)).clamp(0, 1)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(labels))
    chosen = order[:cut] if train else order[cut:]
    return images[chosen].contiguous(), labels[chosen].contiguous()
