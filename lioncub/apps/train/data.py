"""Bundled training data: no downloads.

* `CharText` ("pydoc-topics"): the Python documentation topics that ship with CPython (`pydoc_data.topics`,
  ~465k characters), as a character-level language-modelling corpus.
* `ByteText` ("python-src"): about 41 MB of Python sources and docs (this Python's standard library and the
  sources of numpy, tqdm and simpy), byte-level, split by document, built once into a cached token file
  (lioncub.apps.train.corpus).
* `Blobs`: a synthetic classification task (Gaussian clusters through a fixed random teacher), for the MLP.

Batches are a pure function of (seed, rank, step), so every rank sees different data, and a resumed run
sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import torch

# the text datasets, by the name `lioncub train --data` takes
TEXT_DATASETS = ("pydoc-topics", "python-src")


def _generator(seed: int, rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash((seed, rank, step)) & 0x7FFF_FFFF_FFFF)


class CharText:
    def __init__(self, val_fraction: float = 0.1):
        from pydoc_data.topics import topics

        text = "".join(topics[k] for k in sorted(topics))
        self.chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        data = torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)
        split = int(len(data) * (1 - val_fraction))
        self.train, self.val = data[:split], data[split:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, batch_size: int, block: int, *, seed: int, rank: int, step: int, split: str = "train"):
        data = self.train if split == "train" else self.val
        gen = _generator(seed, rank, step)
        ix = torch.randint(len(data) - block - 1, (batch_size,), generator=gen)
        x = torch.stack([data[i : i + block] for i in ix])
        y = torch.stack([data[i + 1 : i + block + 1] for i in ix])
        return x, y

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


class ByteText:
    """The `python-src` corpus (lioncub.apps.train.corpus), bytes as tokens. The token files are opened (and
    built, if there are none) at the first batch, so a model can be built from `vocab_size` alone."""

    vocab_size = 256

    def __init__(self, progress: bool = True):
        self.progress = progress
        self._splits = None
        self.manifest = None

    def _data(self, split: str):
        if self._splits is None:
            from lioncub.apps.train import corpus

            self.manifest, train, val = corpus.load(progress=self.progress)
            self._splits = dict(train=train, val=val)
        return self._splits["train" if split == "train" else "val"]

    def batch(self, batch_size: int, block: int, *, seed: int, rank: int, step: int, split: str = "train"):
        import numpy as np

        data = self._data(split)
        if len(data) <= block + 1:
            raise ValueError(f"block size {block} is longer than the {split} split ({len(data)} bytes)")
        gen = _generator(seed, rank, step)
        ix = torch.randint(len(data) - block - 1, (batch_size,), generator=gen).tolist()
        rows = torch.from_numpy(np.stack([data[i : i + block + 1] for i in ix])).long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def text_dataset(name: str, progress: bool = True):
    """The text dataset `name` (one of TEXT_DATASETS)."""
    if name == "pydoc-topics":
        return CharText()
    if name == "python-src":
        return ByteText(progress=progress)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(TEXT_DATASETS)}")


class Blobs:
    """Points from `classes` Gaussian clusters in `dim` dimensions, labelled by their cluster."""

    def __init__(self, dim: int = 32, classes: int = 10, noise: float = 1.0, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.dim, self.classes, self.noise = dim, classes, noise
        self.centers = torch.randn(classes, dim, generator=gen) * 2.0

    def batch(self, batch_size: int, block: int = 0, *, seed: int, rank: int, step: int, split: str = "train"):
        gen = _generator(seed + (0 if split == "train" else 10_000), rank, step)
        y = torch.randint(self.classes, (batch_size,), generator=gen)
        x = self.centers[y] + self.noise * torch.randn(batch_size, self.dim, generator=gen)
        return x, y
