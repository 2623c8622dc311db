"""The method registry: every registered method is one unit that the optimizer, the CLIs, the simulator and
autotune all accept, and whose declared costs agree with its declared collectives."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from lioncub.simulator import Cluster, simulate_collective, simulate_step

from lioncub import LionCub, methods
from lioncub.apps import autotune
from lioncub.cli import build_parser
from lioncub.comm import wire

NAMES = list(methods.NAMES)


def test_registry_names_each_method_once_and_rejects_others():
    assert len(set(NAMES)) == len(NAMES) >= 6
    for name, meth in methods.REGISTRY.items():
        assert meth.name == name and methods.get(name) is meth and methods.check(name) == name
        assert meth.summary
    with pytest.raises(ValueError, match=r"unknown method 'sign'; choose one of: " + ", ".join(NAMES)):
        methods.get("sign")


@pytest.mark.parametrize("name", NAMES)
def test_the_optimizer_accepts_every_method(name):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    before = [p.detach().clone() for p in model.parameters()]
    opt = LionCub(model.parameters(), lr=0.1, method=name)
    model(torch.randn(16, 8)).square().mean().backward()
    opt.step()
    # world size 1: plain Lion moves every parameter by exactly lr
    for p, p0 in zip(model.parameters(), before):
        assert torch.allclose((p - p0).abs(), torch.full_like(p, 0.1))


@pytest.mark.parametrize("name", NAMES)
def test_every_cli_offers_every_method(name):
    for argv in (["train", "--method", name], ["simulate", "step", "--method", name, "--ranks", "4", "--params", "1M"],
                 ["autotune", "--methods", name]):
        args = build_parser(argv[0]).parse_args(argv)
        assert name in (getattr(args, "method", None), getattr(args, "methods", None))


@pytest.mark.parametrize("name", NAMES)
def test_the_simulator_costs_every_method_by_its_collectives(name):
    meth, N, n = methods.get(name), 8, 1 << 20
    cluster = Cluster.for_ranks(N, bandwidth="10Gbit")
    r = simulate_collective(cluster, name, "auto", 4 * n)
    colls = meth.collectives(n, N)
    assert r.bytes_sent_per_rank == pytest.approx(wire.traffic(colls, N)[0], rel=1e-3)
    step = simulate_step(cluster, name, params=n, compute_seconds=0.01)
    assert step.bytes_sent_per_rank > 0 and step.step_seconds > 0.01


@pytest.mark.parametrize("name", NAMES)
def test_autotune_searches_every_method(name):
    res = autotune.search(Cluster.for_ranks(8, bandwidth="1Gbit"), 10_000_000, 0.05, methods=[name],
                          momentum_syncs=["none", "every:10"], bucket_mbs=[25])
    assert {c.method for c in res.candidates} == {name}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("N", [2, 3, 4, 8, 64])
def test_declared_bits_per_element_match_the_declared_collectives(name, N):
    """wire_bits_per_element (what the docs and notebooks quote) is the large-n limit of the traffic of
    the collectives the optimizer issues."""
    meth, n = methods.get(name), 1 << 22
    sent, _ = wire.traffic(meth.collectives(n, N), N)
    assert 8 * sent / n == pytest.approx(meth.wire_bits_per_element(N), rel=1e-3)
    assert meth.codec_bytes_per_element(N) >= 0


@pytest.mark.parametrize("name", [n for n in NAMES if not methods.get(n).dense])
@pytest.mark.parametrize("N", [2, 3, 4, 8])
def test_hierarchical_arithmetic_matches_the_exchanges_buffers(name, N):
    """What the simulator costs for the hierarchical layout (agreed_bytes, hierarchical_collectives) is what
    the torch exchange holds: the agreed code's buffer, read back by code_from as the code unpack reads."""
    spec, n, G = methods.get(name), 10_000, 2
    lv = spec.resolve_levels(N)
    x = spec.exchange(n, "cpu", None, levels=lv, world_size=N)
    result = x.result()
    assert result.numel() * result.element_size() == spec.agreed_bytes(n, N, lv)
    def parts(code):
        return code if isinstance(code, tuple) else (code,)

    for a, b in zip(parts(x.code_from(result)), parts(x.agreed())):
        assert (a is None and b is None) or torch.equal(a, b)
    S = wire.shard_elements(n, G)
    ops = spec.hierarchical_collectives(n, N * G, G, lv)
    assert [c.scope for c in ops] == ["node"] + ["cross"] * len(spec.collectives(S, N, lv)) + ["node"]
    assert ops[-1].nbytes == G * spec.agreed_bytes(S, N, lv) and ops[0].nbytes == G * S * 4


def test_the_arithmetic_imports_no_torch():
    code = ("import sys, lioncub.methods as m; [x.collectives(1000, 4) for x in m.REGISTRY.values()]; "
            "assert 'torch' not in sys.modules, sorted(k for k in sys.modules if 'torch' in k)[:5]")
    subprocess.run([sys.executable, "-c", code], check=True)


ADD_A_METHOD = r"""
import contextlib, io, json
import toy_method
toy_method.register()  # what the module's line in lioncub.methods._MODULES does
from lioncub.simulator import Cluster, simulate_step
from lioncub.simulator.profiles import BackendProfile
from lioncub.apps import autotune
from lioncub.cli import main

cluster = Cluster.for_ranks(8, bandwidth="1Gbit")
toy, pbit = (simulate_step(cluster, m, params=10_000_000, compute_seconds=0.05) for m in ("toy-vote", "vote-pbit"))
assert toy.step_seconds == pbit.step_seconds and toy.bytes_sent_per_rank == pbit.bytes_sent_per_rank
res = autotune.search(cluster, 10_000_000, 0.05, methods=["toy-vote"], momentum_syncs=["none"], bucket_mbs=[25])
assert {c.method for c in res.candidates} == {"toy-vote"}
BackendProfile(name="x", codec_bandwidth={"toy-vote": 5e9}).validate()  # a calibrated codec speed is accepted
with contextlib.redirect_stdout(io.StringIO()) as out:
    assert main(["simulate", "step", "--method", "toy-vote", "--ranks", "4", "--params", "1M", "--compute-seconds",
                 "0.05", "--json"]) == 0
assert json.loads(out.getvalue())["method"] == "toy-vote"
print("ok")
"""


def test_adding_a_method_is_one_module_and_its_registry_line():
    """README's "Adding a method": a new module, registered, is trained (bit-identical to the method whose codec
    it copies), simulated, autotuned, calibrated and offered by the CLI, with no other file touched."""
    import toy_method

    from lioncub.comm.spawn import spawn

    toy, pbit = (spawn(toy_method.train, 2, m, timeout=120) for m in ("toy-vote", "vote-pbit"))
    assert all(torch.equal(a, b) for a, b in zip(toy, pbit)) and torch.equal(toy[0], toy[1])
    out = subprocess.run([sys.executable, "-c", ADD_A_METHOD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
