"""`python -m research corpus`: build, show and check the python-src corpus (lioncub.apps.train.corpus)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lioncub.files import read_json


def register(sub) -> None:
    p = sub.add_parser("corpus", help="build, show or check the python-src training corpus",
                       description="python-src: this Python's standard library and the sources of numpy, tqdm and "
                                   "simpy as bytes, split by document, cached as token files (under $LIONCUB_CACHE, "
                                   "else ~/.cache/lioncub). build: make it (about a second); info: what it holds; "
                                   "check: its token files against their manifest, and with --expect against "
                                   "another manifest (the committed one: the GPU runs train on the corpus built "
                                   "here and carried)")
    p.add_argument("action", choices=["build", "info", "check"])
    p.add_argument("--cache-dir", dest="cache_dir", help="the cache root (default $LIONCUB_CACHE, else "
                                                         "~/.cache/lioncub)")
    p.add_argument("--force", action="store_true", help="build: rebuild even if a valid corpus is there")
    p.add_argument("--expect", metavar="MANIFEST", help="check: fail unless the corpus is the one this manifest "
                                                        "describes (sizes and sha256 of the token files and list)")
    p.add_argument("--copy-manifest", dest="copy_manifest", metavar="DIR",
                   help="build, info: also copy manifest.json and files.tsv into DIR (the record of a corpus used "
                        "for results)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from lioncub.apps.train import corpus

    if args.cache_dir:
        os.environ["LIONCUB_CACHE"] = args.cache_dir
    if args.action == "build":
        out = corpus.build(force=args.force)
    else:
        out = corpus.find()
        if out is None:
            raise ValueError(f"no {corpus.NAME} corpus in {', '.join(map(str, corpus.cache_candidates()[0]))} "
                             "(build it: python -m research corpus build)")
    m = corpus.verify(out)
    if args.action == "check" and args.expect:
        diffs = corpus.same_corpus(m, read_json(args.expect, "--expect manifest"))
        if diffs:
            raise ValueError(f"the corpus at {out} is not the one {args.expect} describes: {'; '.join(diffs)}")
    if args.copy_manifest:
        dest = Path(args.copy_manifest)
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("manifest.json", m["file_list"]["path"]):
            shutil.copyfile(out / name, dest / name)
    print(json.dumps(m, indent=1) if args.json else describe(m, out))
    return 0


def describe(m: dict, out) -> str:
    mb = (m["train"]["bytes"] + m["val"]["bytes"]) / 1e6
    lines = [f"{m['name']} at {out}: {mb:.1f} MB in {m['documents']} documents (train {m['train']['bytes']:,} bytes, "
             f"{m['train']['documents']} documents; val {m['val']['bytes']:,} bytes, {m['val']['documents']} "
             f"documents), built by Python {m['python']} in {m['build_seconds']} s; token files match the manifest"]
    for s in m["sources"]:
        lines.append(f"  {s['name']:<7} {s['version']:<16} {s['files']:>5} files {s['bytes'] / 1e6:6.1f} MB  "
                     f"license: {s['license']}")
    if m.get("skipped"):
        lines.append("  skipped: " + ", ".join(f"{n} {why}" for why, n in m["skipped"].items()))
    lines.append(f"  train sha256 {m['train']['sha256']}; val sha256 {m['val']['sha256']}")
    return "\n".join(lines)
