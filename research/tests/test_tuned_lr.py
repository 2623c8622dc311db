"""lioncub's tuned learning rates (lioncub.apps.tuned_lr, TrainConfig's defaults) against the sweeps recorded in the
lab notebook."""

import glob
import json
import statistics

from lioncub.apps.train.loop import TrainConfig
from research import RESULTS
from research import convergence_map as cm


def test_each_models_default_lr_is_the_best_of_its_committed_sweep():
    """The default lr of each transformer is the lowest mean final loss of the allreduce runs in its recorded
    sweep: char-tiny's on this machine (lr-sweep.json), char-small's and char-medium's on an H100."""
    tiny = json.loads((RESULTS / "lr-sweep.json").read_text())
    best = min(tiny["table"], key=lambda row: row["mean"])
    assert best["lr"] == tiny["chosen_default"] == TrainConfig(model="char-tiny").lr == TrainConfig().lr
    for model in ("char-small", "char-medium"):
        res = cm.merge(sorted(glob.glob(str(RESULTS / "models-h100" / "*" / f"{model}-s*.json"))))
        base = {c["lr"]: c for c in res["cells"] if c["config"] == "allreduce"}
        assert len(base) >= 3 and all(len(c["seeds"]) == 4 for c in base.values())
        assert min(base, key=lambda lr: statistics.fmean([r["final_loss"] for r in res["runs"]
                                                          if r["config"] == "allreduce" and r["lr"] == lr])) == \
            TrainConfig(model=model).lr
