"""`python-src`: a byte-level corpus built offline from text that every Python installation carries.

What it holds (`SOURCES`): every `.py` and `.txt` file of this Python's standard library (CPython's own sources,
docstrings and bundled docs: `pydoc_data/topics.py` is the documentation the `char-*` models train on; PSF
License), and the Python sources of three of lioncub's dependencies as installed here: numpy (BSD-3-Clause and
the licenses its metadata lists), tqdm (MPL-2.0 AND MIT) and simpy (MIT). No one here wrote any of it. The
manifest records each source's version, license and root, and `files.tsv` every file taken.

* **Bytes, not characters**: vocabulary 256. A document is one file's bytes followed by a NUL byte (0), which no
  taken file contains (a file with a NUL byte, or not valid UTF-8, is skipped and counted).
* **A deterministic split by document**: a file goes to validation when the first 8 bytes of
  sha256("<source>/<path relative to the source's root>") read as an integer are below VAL_FRACTION x 2^64.
  Never an absolute path, never the file system's order: the documents are concatenated in the sorted order of
  those names.
* **Cached** under `cache_root()/corpus/python-src/`: `train.bin` and `val.bin` (uint8 tokens, read as numpy
  memmaps), `files.tsv` (split, bytes, sha256 and name of every document) and `manifest.json` (sizes, sha256 of
  both token files and of the file list, the sources, the Python that built it). Loading checks the token
  files' sizes and sha256 against the manifest.
* **Built once and carried**: another Python (another version) has other files, so a GPU machine trains on the
  token files built here and carried with the checkout (`LIONCUB_CACHE=.cache`, carry `.cache/corpus`, about
  40 MB), and the research tools' `python -m research corpus check --expect
  research/notebook/results/python-src-corpus/manifest.json` proves they are the committed ones.

The cache root: `$LIONCUB_CACHE` if set (an error if it cannot be used), else `$XDG_CACHE_HOME/lioncub` or
`~/.cache/lioncub`, else (a read-only or foreign home) `<temp dir>/lioncub-cache-<uid>`, said on stderr.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lioncub.files import write_json

NAME = "python-src"
FORMAT = 1
BUILD = "train a byte-* model or call lioncub.apps.train.corpus.build()"  # what an error says to do
VAL_FRACTION = 0.05
SEPARATOR = 0  # the byte that ends every document
SUFFIXES = (".py", ".txt")
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "lib-dynload"})
MAX_FILE_BYTES = 4 << 20  # larger files are data, not text (none in CPython 3.11's standard library)
CHUNK = 1 << 20


@dataclass(frozen=True)
class Source:
    """One tree of files: `name` prefixes its documents' names; `license` as its project states it."""

    name: str
    root: Path
    version: str
    license: str
    suffixes: tuple[str, ...] = SUFFIXES


def _dist_source(dist: str, package: str) -> Source | None:
    """The installed Python sources of a distribution (None when it is not installed)."""
    from importlib import metadata
    from importlib.util import find_spec

    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    meta = metadata.metadata(dist)
    lic = meta.get("License-Expression") or meta.get("License") or next(
        (c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")), "unknown")
    return Source(package, Path(next(iter(spec.submodule_search_locations))), metadata.version(dist),
                  " ".join(lic.split()), (".py",))


def sources() -> list[Source]:
    """This Python's standard library and the installed sources of numpy, tqdm and simpy."""
    stdlib = Source("stdlib", Path(sysconfig.get_paths()["stdlib"]), f"CPython {platform.python_version()}",
                    "PSF-2.0 (Python Software Foundation License Version 2; the standard library's LICENSE.txt)")
    deps = [_dist_source(d, p) for d, p in (("numpy", "numpy"), ("tqdm", "tqdm"), ("simpy", "simpy"))]
    return [stdlib] + [d for d in deps if d is not None]


# --- where the cache lives -------------------------------------------------------------------------------


def _usable(path: Path) -> bool:
    """Whether `path` exists as a writable directory, or can be created as one."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def cache_candidates() -> tuple[list[Path], bool]:
    """(the cache roots to look in, in order; whether the first was set explicitly with $LIONCUB_CACHE)."""
    explicit = os.environ.get("LIONCUB_CACHE")
    if explicit:
        return [Path(explicit).expanduser()], True
    xdg = os.environ.get("XDG_CACHE_HOME")
    home = Path(xdg) / "lioncub" if xdg else Path("~").expanduser() / ".cache" / "lioncub"
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return [home, Path(tempfile.gettempdir()) / f"lioncub-cache-{uid}"], False


def cache_root(for_writing: bool = False) -> Path:
    """The cache root: $LIONCUB_CACHE, else the home cache, else a private temp dir (for_writing: the first one
    that is writable; otherwise the first that exists)."""
    roots, explicit = cache_candidates()
    if not for_writing:
        return next((r for r in roots if r.is_dir()), roots[0])
    for i, root in enumerate(roots):
        if _usable(root):
            if i:
                print(f"lioncub: {roots[0]} is not writable; caching in {root} (set LIONCUB_CACHE to choose)",
                      file=sys.stderr)
            return root
    if explicit:
        raise ValueError(f"LIONCUB_CACHE={roots[0]} is not a writable directory")
    raise ValueError(f"no writable cache directory ({', '.join(map(str, roots))}): set LIONCUB_CACHE to one")


def corpus_dir(root: Path | None = None, name: str = NAME) -> Path:
    return (root or cache_root()) / "corpus" / name


# --- building ----------------------------------------------------------------------------------------------


def is_val(doc: str, val_fraction: float = VAL_FRACTION) -> bool:
    """Whether the document named `doc` ("<source>/<relative path>") is in the validation split."""
    h = int.from_bytes(hashlib.sha256(doc.encode()).digest()[:8], "big")
    return h < val_fraction * 2**64


def _documents(srcs: list[Source]) -> list[tuple[str, Path]]:
    """(document name, path) of every candidate file, sorted by name."""
    docs = []
    for s in srcs:
        for dirpath, dirnames, filenames in os.walk(s.root):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")]
            for f in filenames:
                if f.endswith(s.suffixes):
                    path = Path(dirpath) / f
                    docs.append((f"{s.name}/{path.relative_to(s.root).as_posix()}", path))
    return sorted(docs)


def _text_bytes(path: Path) -> tuple[bytes | None, str]:
    """(the file's bytes, "") if it is a text document we take, else (None, why not)."""
    try:
        if path.is_symlink() or path.stat().st_size > MAX_FILE_BYTES:
            return None, "a link or larger than 4 MiB"
        data = path.read_bytes()
    except OSError:
        return None, "unreadable"
    if b"\0" in data:
        return None, "contains a NUL byte"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    return data, ""


def build(root: Path | None = None, *, force: bool = False, progress: bool = True,
          srcs: list[Source] | None = None) -> Path:
    """Build the corpus under `root` (default: the writable cache root) unless a valid one is there; returns
    its directory. Concurrent callers (ranks) wait for one build."""
    root = root or cache_root(for_writing=True)
    out = corpus_dir(root)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the corpus directory {out}: {exc.strerror or exc}") from None
    with _lock(out.parent / f".{NAME}.lock"):
        if not force:
            with contextlib.suppress(ValueError):
                verify(out)
                return out
        _write(out, srcs or sources(), progress)
    return out


@contextlib.contextmanager
def _lock(path: Path):
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write(out: Path, srcs: list[Source], progress: bool) -> None:
    from tqdm import tqdm

    t0 = time.perf_counter()
    docs = _documents(srcs)
    per_source = {s.name: dict(files=0, bytes=0) for s in srcs}
    skipped: dict[str, int] = {}
    rows = []
    splits = {"train": dict(bytes=0, documents=0, sha=hashlib.sha256()),
              "val": dict(bytes=0, documents=0, sha=hashlib.sha256())}
    tmp = {k: out / f"{k}.bin.tmp" for k in splits}
    with open(tmp["train"], "wb") as ftrain, open(tmp["val"], "wb") as fval:
        files = dict(train=ftrain, val=fval)
        for doc, path in tqdm(docs, desc=f"building {NAME}", unit="file", disable=not progress, leave=False):
            data, why = _text_bytes(path)
            if data is None:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            split = "val" if is_val(doc) else "train"
            chunk = data + bytes([SEPARATOR])
            files[split].write(chunk)
            s = splits[split]
            s["sha"].update(chunk)
            s["bytes"] += len(chunk)
            s["documents"] += 1
            src = per_source[doc.split("/", 1)[0]]
            src["files"] += 1
            src["bytes"] += len(data)
            rows.append(f"{split}\t{len(data)}\t{hashlib.sha256(data).hexdigest()}\t{doc}\n")
    if not splits["train"]["documents"] or not splits["val"]["documents"]:
        raise ValueError(f"{NAME}: too few text files found to split ({len(rows)}); is this Python's standard "
                         "library installed?")
    listing = "".join(rows).encode()
    (out / "files.tsv").write_bytes(listing)
    for k in splits:
        os.replace(tmp[k], out / f"{k}.bin")
    manifest = dict(
        format=FORMAT, name=NAME, vocab_size=256, separator=SEPARATOR, val_fraction=VAL_FRACTION,
        split_rule="val iff int(sha256('<source>/<relative path>')[:8]) < val_fraction * 2**64",
        built=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        python=platform.python_version(), platform=platform.platform(), build_seconds=0.0,
        sources=[dict(name=s.name, version=s.version, license=s.license, root=str(s.root),
                      suffixes=list(s.suffixes), **per_source[s.name]) for s in srcs],
        documents=len(rows), skipped=dict(sorted(skipped.items())),
        file_list=dict(path="files.tsv", sha256=hashlib.sha256(listing).hexdigest(), bytes=len(listing)),
        **{k: dict(path=f"{k}.bin", bytes=v["bytes"], documents=v["documents"], sha256=v["sha"].hexdigest())
           for k, v in splits.items()})
    manifest["build_seconds"] = round(time.perf_counter() - t0, 2)
    write_json(out / "manifest.json", manifest, newline=True)  # last: a corpus without its manifest is not one


# --- loading ---------------------------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(out: Path) -> dict:
    path = out / "manifest.json"
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no {NAME} corpus at {out} (build it: {BUILD})") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("name") != NAME:
        raise ValueError(f"{path}: not a {NAME} manifest of format {FORMAT}")
    return m


def verify(out: Path) -> dict:
    """The manifest of the corpus in `out`, after checking both token files' sizes and sha256 against it."""
    m = read_manifest(out)
    for split in ("train", "val"):
        path = out / m[split]["path"]
        try:
            size = path.stat().st_size
        except OSError:
            raise ValueError(f"{NAME} at {out}: {path.name} is missing (rebuild: remove {out}, then {BUILD})") \
                from None
        if size != m[split]["bytes"] or _sha256_file(path) != m[split]["sha256"]:
            raise ValueError(f"{NAME} at {out}: {path.name} does not match its manifest (size or sha256): a "
                             f"truncated or altered copy (rebuild: remove {out}, then {BUILD})")
    return m


def find() -> Path | None:
    """The directory of a corpus with a manifest in the cache roots, or None."""
    roots, _ = cache_candidates()
    return next((corpus_dir(r) for r in roots if (corpus_dir(r) / "manifest.json").is_file()), None)


def load(*, build_missing: bool = True, progress: bool = True):
    """(manifest, train tokens, val tokens) of the cached corpus, checked against its manifest; built first when
    there is none (build_missing)."""
    import numpy as np

    out = find()
    if out is None:
        if not build_missing:
            raise ValueError(f"no {NAME} corpus in {', '.join(map(str, cache_candidates()[0]))} "
                             f"(build it: {BUILD})")
        out = build(progress=progress)
    m = verify(out)
    train = np.memmap(out / m["train"]["path"], dtype=np.uint8, mode="r")
    val = np.memmap(out / m["val"]["path"], dtype=np.uint8, mode="r")
    return m, train, val


def same_corpus(m: dict, expected: dict) -> list[str]:
    """What differs between a manifest and an expected one (the token files and the file list), [] if nothing."""
    diffs = []
    for key in ("train", "val", "file_list"):
        for field in ("bytes", "sha256"):
            a, b = m.get(key, {}).get(field), expected.get(key, {}).get(field)
            if a != b:
                diffs.append(f"{key} {field} {a} (expected {b})")
    return diffs
