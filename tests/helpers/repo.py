"""Where things are, for the tests: the repository and this helpers folder."""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parents[1]
