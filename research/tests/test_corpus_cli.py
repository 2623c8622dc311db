"""`python -m research corpus`: the python-src corpus (lioncub.apps.train.corpus) built, shown and checked
against an expected manifest, as the GPU runs carry it."""

import json

import pytest

from lioncub.apps.train import corpus
from research.cli import main


@pytest.fixture(scope="module")
def real_corpus():
    """The real corpus, in the session's cache (built once: later builds find it)."""
    return corpus.verify(corpus.build(progress=False))


def test_corpus_cli_builds_checks_and_compares_with_an_expected_manifest(real_corpus, tmp_path, capsys):
    assert main(["corpus", "info"]) == 0
    assert "python-src at" in capsys.readouterr().out
    assert main(["corpus", "check", "--copy-manifest", str(tmp_path / "rec")]) == 0
    expected = json.loads((tmp_path / "rec" / "manifest.json").read_text())
    assert (tmp_path / "rec" / "files.tsv").exists()
    assert main(["corpus", "check", "--expect", str(tmp_path / "rec" / "manifest.json")]) == 0
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(expected, train=dict(expected["train"], sha256="0" * 64))))
    capsys.readouterr()
    assert main(["corpus", "check", "--expect", str(other)]) == 2
    assert "is not the one" in capsys.readouterr().err
