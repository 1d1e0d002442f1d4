"""Inputs: synthetic normal batches (as in the dissertation) and a small real image set (8x8 digits).

The digits come from scikit-learn's bundled copy of the UCI handwritten digits
(1,797 images of 8 x 8 pixels, 10 classes), which ships inside the package, so
no network is needed at run time.  Only the data file is read; scikit-learn
itself is never imported.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np


def synthetic_batch(iteration: int, batch: int, image: int, channels: int, classes: int,
                    seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A batch of standard-normal NHWC images and uniform labels; the same ``(seed, iteration)`` gives
    the same batch, so every mode trains on identical data."""
    rng = np.random.default_rng([seed, iteration])
    x = rng.standard_normal((batch, image, image, channels), dtype=np.float32)
    y = rng.integers(0, classes, batch, dtype=np.int32)
    return x, y


@dataclass
class Digits:
    """Train and test split of the 8x8 digits, NHWC float32 in [0, 1] and int32 labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: int = 10

    def batch(self, iteration: int, batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """A shuffled training batch (epoch-wise permutation, deterministic in ``seed`` and ``iteration``)."""
        n = len(self.x_train)
        per_epoch = max(1, n // batch)
        epoch, k = divmod(iteration, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        idx = order[k * batch:(k + 1) * batch]
        return self.x_train[idx], self.y_train[idx]


def digits_path() -> str:
    """Where scikit-learn keeps its bundled ``digits.csv.gz`` (found without importing scikit-learn)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("--data digits needs scikit-learn, which ships the 8x8 digits data set: "
                          "pip install scikit-learn")
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"scikit-learn is installed but its digits data is missing: {path}")
    return path


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Digits:
    """The digits set split into train and test.

    Reads the CSV that scikit-learn ships (64 pixel values 0..16 and the label
    per row) directly: importing all of scikit-learn would take seconds and
    pull in joblib for nothing.
    """
    raw = np.loadtxt(digits_path(), delimiter=",", dtype=np.float32)
    x = (raw[:, :64] / 16.0).reshape(-1, 8, 8, 1)
    y = raw[:, 64].astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    ntest = int(round(len(x) * test_fraction))
    test, train = order[:ntest], order[ntest:]
    return Digits(np.ascontiguousarray(x[train]), y[train], np.ascontiguousarray(x[test]), y[test])
