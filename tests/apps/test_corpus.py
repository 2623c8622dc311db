"""The python-src corpus (lioncub.apps.train.corpus): what it takes, its split, its cache and its checks; the byte
dataset's batches; the byte models."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from lioncub.apps.train import corpus
from lioncub.apps.train.data import ByteText


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


FILES = {f"pkg/mod{i:02d}.py": f"def f{i}():\n    return {i}  # é\n".encode() for i in range(40)}
FILES.update({"notes.txt": b"plain text\n", "pkg/__pycache__/x.py": b"cached\n", "data.bin": b"\x01\x02",
              "bad.py": b"\xff\xfe not utf-8\n", "nul.py": b"a\x00b\n", "site-packages/other.py": b"x = 1\n"})


def _source(root: Path) -> corpus.Source:
    return corpus.Source("src", root, "1.0", "MIT")


def test_build_takes_the_text_files_in_name_order_and_splits_by_a_hash_of_the_name(tmp_path):
    src = _tree(tmp_path / "a", FILES)
    out = corpus.build(tmp_path / "cache", srcs=[_source(src)], progress=False)
    m = corpus.verify(out)
    taken = sorted(k for k in FILES if k.endswith((".py", ".txt")) and "__pycache__" not in k
                   and "site-packages" not in k and k not in ("bad.py", "nul.py"))
    assert m["documents"] == len(taken) and m["skipped"] == {"contains a NUL byte": 1, "not UTF-8": 1}
    # the oracle: the split recomputed with hashlib from the documents' names alone
    val = [k for k in taken if int.from_bytes(hashlib.sha256(f"src/{k}".encode()).digest()[:8], "big")
           < corpus.VAL_FRACTION * 2**64]
    train = [k for k in taken if k not in val]
    assert val and train
    for split, names in (("train", train), ("val", val)):
        expected = b"".join(FILES[k] + b"\0" for k in names)
        assert (out / f"{split}.bin").read_bytes() == expected
        assert m[split] | {"path": None} == dict(path=None, bytes=len(expected), documents=len(names),
                                                 sha256=hashlib.sha256(expected).hexdigest())
    rows = [line.split("\t") for line in (out / "files.tsv").read_text().splitlines()]
    assert [r[3] for r in rows] == [f"src/{k}" for k in taken] and {r[0] for r in rows} == {"train", "val"}
    assert m["file_list"]["sha256"] == hashlib.sha256((out / "files.tsv").read_bytes()).hexdigest()
    assert m["sources"] == [dict(name="src", version="1.0", license="MIT", root=str(src), suffixes=[".py", ".txt"],
                                 files=len(taken), bytes=sum(len(FILES[k]) for k in taken))]


def test_the_token_files_do_not_depend_on_where_the_files_are_or_the_order_they_were_made(tmp_path):
    a = _tree(tmp_path / "first" / "place", FILES)
    b = _tree(tmp_path / "elsewhere", dict(reversed(list(FILES.items()))))  # created in the other order
    ma = corpus.verify(corpus.build(tmp_path / "ca", srcs=[_source(a)], progress=False))
    mb = corpus.verify(corpus.build(tmp_path / "cb", srcs=[_source(b)], progress=False))
    assert corpus.same_corpus(ma, mb) == [] and ma["sources"][0]["root"] != mb["sources"][0]["root"]


def test_a_valid_corpus_is_kept_and_an_altered_one_is_refused_then_rebuilt(tmp_path):
    src = _tree(tmp_path / "a", FILES)
    out = corpus.build(tmp_path / "c", srcs=[_source(src)], progress=False)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert corpus.build(tmp_path / "c", srcs=[_source(src)], progress=False) == out
    assert (out / "manifest.json").stat().st_mtime_ns == stamp  # not rebuilt
    good = (out / "train.bin").read_bytes()
    data = bytearray(good)
    data[3] ^= 1
    (out / "train.bin").write_bytes(bytes(data))  # same size, other bytes
    with pytest.raises(ValueError, match="train.bin does not match its manifest"):
        corpus.verify(out)
    (out / "train.bin").write_bytes(good)
    (out / "val.bin").unlink()
    with pytest.raises(ValueError, match="val.bin is missing"):
        corpus.verify(out)
    corpus.build(tmp_path / "c", srcs=[_source(src)], progress=False)
    assert corpus.verify(out)["documents"] > 0


def test_the_cache_root_falls_back_from_an_unwritable_home_and_an_explicit_one_must_work(tmp_path, monkeypatch,
                                                                                        capsys):
    blocker = tmp_path / "home-is-a-file"
    blocker.write_text("")
    monkeypatch.delenv("LIONCUB_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(blocker))  # ~/.cache cannot be created under a file (as under a 0500 home)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    root = corpus.cache_root(for_writing=True)
    assert root == tmp_path / "tmp" / f"lioncub-cache-{os.getuid()}" and root.is_dir()
    assert "is not writable; caching in" in capsys.readouterr().err
    monkeypatch.setenv("LIONCUB_CACHE", str(blocker / "x"))
    with pytest.raises(ValueError, match="LIONCUB_CACHE=.* is not a writable directory"):
        corpus.cache_root(for_writing=True)
    monkeypatch.setenv("LIONCUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"no python-src corpus in .*build it: train a byte-\* model"):
        corpus.load(build_missing=False)


@pytest.fixture(scope="module")
def real_corpus():
    """The real corpus, in the session's cache (conftest sets LIONCUB_CACHE)."""
    return corpus.verify(corpus.build(progress=False))


def test_the_real_corpus_is_tens_of_mb_of_cpython_and_dependency_sources(real_corpus):
    m = real_corpus
    total = m["train"]["bytes"] + m["val"]["bytes"]
    assert 20e6 < total < 60e6  # tens of MB, and with the manifest well under the 64 MiB a GPU loan can carry
    names = [s["name"] for s in m["sources"]]
    assert names[0] == "stdlib" and "PSF" in m["sources"][0]["license"] and m["sources"][0]["files"] > 1000
    assert 0.03 < m["val"]["bytes"] / total < 0.08 and m["build_seconds"] < 60
    out = corpus.find()
    listing = (out / "files.tsv").read_text()
    assert "\tstdlib/json/__init__.py\n" in listing and "\tstdlib/pydoc_data/topics.py\n" in listing


def test_byte_batches_are_a_pure_function_of_seed_rank_and_step(real_corpus):
    a, b = ByteText(progress=False), ByteText(progress=False)
    x, y = a.batch(4, 32, seed=3, rank=1, step=7)
    x2, y2 = b.batch(4, 32, seed=3, rank=1, step=7)
    assert torch.equal(x, x2) and torch.equal(y, y2) and x.dtype == torch.long and x.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    assert not torch.equal(x, a.batch(4, 32, seed=3, rank=2, step=7)[0])
    assert not torch.equal(x, a.batch(4, 32, seed=3, rank=1, step=8)[0])
    train = np.memmap(corpus.find() / "train.bin", dtype=np.uint8, mode="r")
    gen = torch.Generator().manual_seed(hash((3, 1, 7)) & 0x7FFF_FFFF_FFFF)  # the oracle: CharText's generator
    starts = torch.randint(len(train) - 33, (4,), generator=gen).tolist()
    assert x.tolist() == [list(train[i:i + 32]) for i in starts]
    v, _ = a.batch(2, 16, seed=0, rank=0, step=0, split="val")
    assert v.max() < 256 and isinstance(a.decode(v[0]), str)


def test_a_copied_corpus_is_found_where_lioncub_cache_points(real_corpus, tmp_path, monkeypatch):
    """What the GPU machine does: the token files built here, carried under .cache/corpus, found by
    LIONCUB_CACHE=.cache and checked against the manifest."""
    carried = tmp_path / "checkout" / ".cache"
    shutil.copytree(corpus.find(), carried / "corpus" / "python-src")
    monkeypatch.setenv("LIONCUB_CACHE", str(carried))
    m, train, val = corpus.load(build_missing=False)
    assert corpus.same_corpus(m, real_corpus) == [] and len(train) == m["train"]["bytes"]
