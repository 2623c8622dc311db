"""Autotune for the machine at hand (issue 51): the user's compute per step measured and the devices read
(`measure_here`, `--model-fn`, `--here`), the bytes per step split into inside the node and leaving it, and
Lion's lr and weight decay (given, a built-in's, or converted from AdamW's: `--adamw-lr`)."""

from __future__ import annotations

import json
import statistics
import types

import pytest
import torch
from lioncub.simulator import Cluster, simulate_step

from lioncub.apps import autotune
from lioncub.apps.autotune import here as here_mod
from lioncub.apps.autotune.here import load_model_fn, measure_here, read_devices
from lioncub.apps.tuned_lr import ADAMW_TO_LION, DEFAULT_LR, lion_from_adamw
from lioncub.cli import main


def run_json(capsys, *argv):
    assert main(["autotune", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_text(capsys, *argv):
    assert main(["autotune", *argv]) == 0
    return capsys.readouterr().out


FAST = ["--local-steps", "none", "--bucket-mb", "25", "--momentum-sync", "none,every:8"]


# ---------------------------------------------------------------------------------------------------------
# measure_here and read_devices
# ---------------------------------------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def test_measure_here_times_forward_and_backward_of_a_tiny_model_on_cpu():
    model = _mlp().eval()
    x = torch.randn(16, 32)
    calls = []

    def loss_fn(m, batch):
        calls.append(m.training)
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    h = measure_here(model, (x, x.sum(1, keepdim=True)), loss_fn, steps=4, warmup=2)
    assert h.params == 32 * 64 + 64 + 64 + 1 == sum(p.numel() for p in model.parameters())
    assert len(calls) == 6 and all(calls)  # 2 warm-up + 4 timed steps, each in train mode
    assert len(h.samples) == 4 and h.compute_seconds == statistics.median(h.samples)
    assert 0 < h.compute_seconds < 5
    assert not model.training and all(p.grad is None for p in model.parameters())  # left as it was
    assert (h.device, h.backend, h.gpus_per_node) == ("cpu", "gloo", 1)
    assert "measured here" in h.compute_basis and "median of 4 after 2 warm-up" in h.compute_basis
    d = h.to_dict()
    assert d["backend"] == "gloo" and d["devices"]["device"] == "cpu" and d["params"] == h.params
    c = h.cluster(nodes=3, bandwidth="1Gbit")
    assert (c.nodes, c.gpus_per_node, c.ranks) == (3, 1, 3)
    # what the search takes
    res = autotune.search(c, h.params, h.compute_seconds, backend=h.backend, steps=100, local_steps=None,
                          bucket_mbs=[25], momentum_syncs=["none"])
    assert res.ranked


class _Out:  # a Hugging Face ModelOutput's shape: .loss and .logits
    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


class _HFLike(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 50)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return _Out(loss, logits)


class _PairModel(_HFLike):  # nanoGPT's (logits, loss)
    def forward(self, x, y):
        out = super().forward(x, labels=y)
        return out.logits, out.loss


def test_measure_here_finds_the_loss_without_a_loss_fn():
    ids = torch.randint(0, 50, (4, 12))
    h = measure_here(_HFLike(), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, steps=2)
    assert h.params == 50 * 8 + 8 * 50 + 50
    assert measure_here(_PairModel(), (ids, ids), steps=1, warmup=0).params == h.params
    assert measure_here(_mlp(), torch.randn(3, 32), steps=1).compute_seconds > 0  # a plain output: its sum
    frozen = _mlp()
    frozen[0].weight.requires_grad_(False)
    assert measure_here(frozen, torch.randn(3, 32), steps=1).params == 64 + 64 + 1  # trainable ones only


@pytest.mark.parametrize("kw, match", [
    (dict(steps=0), "steps"), (dict(warmup=-1), "warmup"),
    (dict(loss_fn=lambda m, b: m(b)), "scalar"),
])
def test_measure_here_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        measure_here(_mlp(), torch.randn(3, 32), **kw)


def _fake_cuda(monkeypatch, count=4):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="Fake GPU", total_memory=80 * 2**30))


def test_read_devices_cpu_and_cuda(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = read_devices()
    assert (cpu.device, cpu.count, cpu.gpus_per_node, cpu.backend) == ("cpu", 1, 1, "gloo")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # CPU ranks per node under torchrun
    assert read_devices().gpus_per_node == 2
    _fake_cuda(monkeypatch)
    gpu = read_devices()
    assert (gpu.device, gpu.count, gpu.gpus_per_node, gpu.backend, gpu.memory_bytes) == \
        ("cuda", 4, 4, "nccl", 80 * 2**30)
    assert "4 x Fake GPU" in gpu.describe()


# ---------------------------------------------------------------------------------------------------------
# --model-fn and --here
# ---------------------------------------------------------------------------------------------------------
MODEL_FILE = '''
import torch

def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    x = torch.randn(16, 32)
    return model, (x, x.sum(1, keepdim=True)), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])

def as_dict():
    model, batch, _ = build()
    return {"model": model, "batch": batch[0]}

def bad():
    return 3
'''


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    (tmp_path / "user_model.py").write_text(MODEL_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return tmp_path / "user_model.py"


def test_model_fn_and_here_on_cpu(model_file, capsys, tmp_path):
    out = run_json(capsys, "--model-fn", "user_model:build", "--here", "--nodes", "4", "--bandwidth", "1Gbit", *FAST,
                   "--measure-steps", "3", "--output", str(tmp_path / "cfg.json"))
    assert out["model"]["params"] == 2177 and out["model"]["name"] == "build" and not out["model"]["builtin"]
    assert "measured here" in out["model"]["compute_basis"] and out["model"]["compute_seconds"] > 0
    assert (out["cluster"]["nodes"], out["cluster"]["gpus_per_node"], out["cluster"]["backend"]) == (4, 1, "gloo")
    assert len(out["here"]["measured"]["samples"]) == 3 and out["here"]["devices"]["backend"] == "gloo"
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["here"] == out["here"] and cfg["cluster"]["backend"] == "gloo"
    # a file path and a dict work too; --here alone is this machine (one node)
    out = run_json(capsys, "--model-fn", f"{model_file}:as_dict", "--here", *FAST, "--measure-steps", "1")
    assert out["model"]["params"] == 2177 and out["cluster"]["ranks"] == 1
    assert load_model_fn("user_model:build")[2] is not None and load_model_fn("user_model:as_dict")[2] is None


def test_here_reads_a_gpu_node(model_file, capsys, monkeypatch):
    _fake_cuda(monkeypatch, 4)
    out = run_json(capsys, "--params", "10M", "--compute-seconds", "0.05", "--here", "--nodes", "2", *FAST)
    assert (out["cluster"]["nodes"], out["cluster"]["gpus_per_node"], out["cluster"]["backend"]) == (2, 4, "nccl")
    assert "--here: 4 x Fake GPU" in out["cluster"]["description"]
    out = run_json(capsys, "--params", "10M", "--compute-seconds", "0.05", "--here", "--nodes", "2",
                   "--gpus-per-node", "2", "--backend", "gloo", *FAST)  # explicit flags win
    assert (out["cluster"]["gpus_per_node"], out["cluster"]["backend"]) == (2, "gloo")


@pytest.mark.parametrize("argv, match", [
    (["--model-fn", "user_model:build", "--model", "char-tiny"], "not more than one"),
    (["--model-fn", "user_model:build", "--compute-seconds", "0.1"], "measures the compute"),
    (["--model-fn", "user_model"], "module:function"),
    (["--model-fn", "no_such_module_xyz:f"], "cannot import"),
    (["--model-fn", "user_model:nothing"], "no function"),
    (["--model-fn", "user_model:bad"], "must return"),
])
def test_model_fn_bad_input(model_file, argv, match, capsys):
    assert main(["autotune", *argv, "--here", *FAST]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lioncub: error:") and match in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------------
# bytes per step: inside the node and leaving it
# ---------------------------------------------------------------------------------------------------------
def test_bytes_split_on_2_nodes_of_4_gpus_against_a_hand_count():
    """allreduce (fp32 gradients, flat ring over ranks 0-3 on node A, 4-7 on node B) of P parameters, B = 4P
    bytes: every rank sends 2(N-1)/N B = 7/4 B; only the two ranks at the node boundaries (3 -> 4, 7 -> 0) send
    across, each the same 7/4 B, so each node's NIC carries 7/4 B, 7/16 B per rank, and 21/16 B per rank stay
    inside the node."""
    P = 2**20
    B = 4 * P
    cluster = Cluster(nodes=2, gpus_per_node=4, bandwidth="10Gbit", latency="20us")
    res = autotune.search(cluster, P, 0.1, steps=100, methods=["allreduce"], bucket_mbs=[25], algorithms="flat",
                          local_steps=None)
    c = res.ranked[0]
    assert c.method == "allreduce" and c.algorithms == {"allreduce": "ring"}
    assert c.bytes_per_step == pytest.approx(7 / 4 * B)
    assert c.bytes_leaving_node_per_step == pytest.approx(7 / 16 * B)
    assert c.bytes_inside_node_per_step == pytest.approx(21 / 16 * B)
    assert res.baseline["bytes_leaving_node_per_rank"] == pytest.approx(7 / 16 * B)
    # one GPU per node: everything leaves
    flat1 = autotune.search(Cluster(nodes=8, gpus_per_node=1), P, 0.1, steps=100, methods=["allreduce"],
                            bucket_mbs=[25], local_steps=None).ranked[0]
    assert flat1.bytes_inside_node_per_step == 0 and flat1.bytes_leaving_node_per_step == pytest.approx(7 / 4 * B)


def test_bytes_split_adds_up_in_every_layout_and_schedule(capsys):
    cluster = Cluster(nodes=2, gpus_per_node=4, bandwidth="10Gbit", latency="20us")
    res = autotune.search(cluster, 3_000_000, 0.05, steps=1000, bucket_mbs=[4, 25],
                          momentum_syncs=["none", "every:8", "geometric:8", "adaptive"], local_steps="measured")
    layouts = {c.layout for c in res.candidates}
    assert {"flat", "hierarchical", "sharded"} <= layouts
    for c in res.candidates:
        assert c.bytes_inside_node_per_step >= 0 and c.bytes_leaving_node_per_step >= 0
        both = c.bytes_inside_node_per_step + c.bytes_leaving_node_per_step
        assert both == pytest.approx(c.bytes_per_step), c.label()
    hier = next(c for c in res.candidates if c.layout == "hierarchical" and c.momentum_sync == "none"
                and not c.local_steps)
    flat = res.twin(hier, "flat")
    assert hier.bytes_leaving_node_per_step < flat.bytes_leaving_node_per_step  # the node layout's point
    # direct from the simulator: what leaves is the NIC's bytes over the node's ranks
    r = simulate_step(cluster, hier.method, 3_000_000, None, hier.bucket_mb, 0.05, levels=hier.levels,
                      hierarchical=True)
    assert hier.bytes_leaving_node_per_step == pytest.approx(r.nic_bytes_per_node / 4)
    # in the text and the JSON
    argv = ["--params", "3M", "--compute-seconds", "0.05", "--nodes", "2", "--gpus-per-node", "4", *FAST]
    text = run_text(capsys, *argv)
    assert "in node" in text and "leaves node" in text and "inside the node" in text and "leaving it" in text
    out = run_json(capsys, *argv)
    pred = out["recommended"]["predicted"]
    assert pred["bytes_inside_node_per_rank"] + pred["bytes_leaving_node_per_rank"] == \
        pytest.approx(pred["bytes_sent_per_rank"])
    assert pred["bytes_leaving_per_node"] == pytest.approx(4 * pred["bytes_leaving_node_per_rank"])
    assert all("bytes_leaving_node_per_step" in c for c in out["ranked"])


# ---------------------------------------------------------------------------------------------------------
# lr and weight decay: from AdamW's, given, a built-in's
# ---------------------------------------------------------------------------------------------------------
def test_adamw_lr_and_weight_decay_become_lions(capsys, tmp_path):
    lr, wd = lion_from_adamw(3e-4, 0.1)
    assert lr == pytest.approx(3e-4 / ADAMW_TO_LION["lr_divisor"])
    assert wd == pytest.approx(0.1 * ADAMW_TO_LION["wd_factor"])
    argv = ["--params", "124M", "--compute-seconds", "0.3", "--ranks", "16", "--bandwidth", "10Gbit", *FAST,
            "--adamw-lr", "3e-4", "--adamw-weight-decay", "0.1"]
    text = run_text(capsys, *argv, "--output", str(tmp_path / "cfg.json"))
    assert f"lr={lr:.3g}, weight_decay={wd:.3g}, method=" in text and "lr=..." not in text
    assert "from AdamW's lr 0.0003" in text and ADAMW_TO_LION["measured"] in text
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["lion"]["lr"] == pytest.approx(lr) and cfg["lion"]["weight_decay"] == pytest.approx(wd)
    assert cfg["lion"]["adamw"] == {"lr": 3e-4, "weight_decay": 0.1}
    assert cfg["train"]["lr"] == pytest.approx(lr) and cfg["train"]["weight_decay"] == pytest.approx(wd)
    assert "lr" not in cfg["optimizer"]  # LionCub(params, lr=..., **cfg["optimizer"]) keeps working
    # the risk rule reads the converted lr as the tuned one, as it reads --lr for a custom model
    same = run_json(capsys, *argv[:-4], "--lr", str(lr), "--weight-decay", str(wd))
    conv = run_json(capsys, *argv)
    assert [c["risk"] for c in same["ranked"]] == [c["risk"] for c in conv["ranked"]]
    # without --adamw-weight-decay, 0.1 is assumed and said
    text = run_text(capsys, *argv[:-2])
    assert "(assumed: --adamw-weight-decay)" in text


def test_lr_printed_for_a_builtin_and_hinted_otherwise(capsys):
    text = run_text(capsys, "--model", "char-tiny", "--ranks", "4", "--bandwidth", "100Mbit", "--compute-seconds",
                    "0.1", *FAST)
    assert f"lr={DEFAULT_LR['char-tiny']:.3g}, weight_decay=0.1, method=" in text and "tuned default" in text
    text = run_text(capsys, "--params", "124M", "--compute-seconds", "0.3", "--ranks", "16", *FAST)
    assert "lr=..., method=" in text and "--adamw-lr" in text


@pytest.mark.parametrize("argv, match", [
    (["--adamw-lr", "1e-3", "--lr", "1e-4"], "not both"),
    (["--adamw-weight-decay", "0.1"], "goes with --adamw-lr"),
    (["--adamw-lr", "0"], "must be > 0"),
    (["--adamw-lr", "1e-3", "--adamw-weight-decay=-1"], ">= 0"),
])
def test_lr_flags_bad_input(argv, match, capsys):
    assert main(["autotune", "--params", "1M", "--compute-seconds", "0.1", "--ranks", "4", *FAST, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lioncub: error:") and match in err and "Traceback" not in err


def test_here_module_imports_no_torch_at_import():
    assert "torch" not in here_mod.__dict__
