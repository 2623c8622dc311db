"""`make gpu-check` rehearsed without a GPU: the whole script on CPU tensors (Triton interpreter, tiny sizes),
its failure handling, and the pieces that only matter on a GPU, fed with GPU-like data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from repo import REPO

from lioncub import methods

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402  (an operations script, importable from scripts/)

# the rehearsal checks what each step does, not how fast: on a busy machine every step gets ample time (the
# limits of a GPU run are the script's own; the subprocess timeout only guards against a hang)
REHEARSAL_LIMITS = ",".join(f"{step}=900" for step in gpu_check.STEPS)


def run_check(out, *args, env=None, timeout=3600):
    env = dict(os.environ, PYTHON=sys.executable, **{"LIONCUB_GPU_CHECK_TIMEOUTS": REHEARSAL_LIMITS, **(env or {})})
    for k in ("LIONCUB_GPU_CHECK_SIZE", "LIONCUB_KERNELS", "TRITON_INTERPRET", "LIONCUB_TEST_DEVICE"):
        env.pop(k, None)
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_rehearsal_runs_every_step_and_writes_json_and_summary(tmp_path):
    r = run_check(tmp_path / "gc", "--device", "cpu")
    out = tmp_path / "gc"
    summary = (out / "summary.txt").read_text()
    assert r.returncode == 0, summary + r.stdout[-3000:] + r.stderr[-3000:]
    assert f"PASS ({len(gpu_check.STEPS)}/{len(gpu_check.STEPS)} steps passed)" in summary and "rehearsal" in summary
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["status"] == "pass" and report["device"] == "cpu" and report["size"] == "tiny"
    steps = {name: json.loads((out / f"{i:02d}-{name}.json").read_text())
             for i, name in enumerate(gpu_check.STEPS, 1)}
    for name, s in steps.items():
        assert s["status"] == "pass" and s["checks"] and all(s["checks"].values()), (name, s["checks"])
        assert s["summary"], name
    assert steps["env"]["copy"]["gbps"] > 0 and steps["env"]["copy"]["meaningful"] is False
    assert "smoke ok" in steps["install"]["smoke"]
    assert steps["tests"]["counts"]["passed"] >= 10 and steps["tests"]["mismatches"]["comparisons"] > 0
    assert steps["tests"]["mismatches"]["twin_mismatches"] == 0  # the interpreter reproduces the twins exactly
    assert steps["bench"]["runs"]["float32"]["copy_gbps"] > 0
    assert set(steps["optimizer"]["step_ms"]) >= {"lioncub", "torch AdamW(fused=True)"}
    assert steps["optimizer"]["backend"] == "lioncub.kernels.triton_ops"
    cb = steps["optimizer"]["check_in_backward"]
    assert cb["flags_used"] and set(cb["ms"]) == {"check in backward", "no check"}
    assert set(cb["compute_bound_backward"]["ms"]["no check"]) == {"backward", "step", "iteration"}
    ranks = steps["ranks"]["runs"]["2"]
    assert len(ranks["methods"]) == 2 * len(methods.NAMES) and all(ranks["triton_equals_torch"].values())
    assert all(m["ran"] == "lioncub.kernels.triton_ops" for k, m in ranks["methods"].items() if k.startswith("triton"))
    train = steps["train"]
    assert train["triton_vs_torch"]["identical"] and train["verdict"] == "bit-identical loss curves"
    assert train["runs"]["triton"]["ran"] == "lioncub.kernels.triton_ops"
    assert train["runs"]["torch"]["ran"] == "lioncub.kernels.reference"
    nccl = steps["nccl"]  # on CPU the same code on Gloo: init_distributed's choice, with every check
    assert nccl["backend"] == "gloo" and len(nccl["checks"]) == 7
    assert set(nccl["exchange_mismatches"]) == {f"{m} ({g})" for m in methods.NAMES for g in ("default group",
                                                                                                "subgroup")}
    # every method with overlap on and off, the compressed ones flat and hierarchical
    assert nccl["optimizer_runs"] == sum(2 if methods.get(m).dense else 4 for m in methods.NAMES)
    assert all(v["moved"] == [True, True, False, True] for v in nccl["grad_scaler"].values())
    assert nccl["checkpoint_load"]["momenta"] == "own"


def test_a_failed_or_hung_step_fails_the_run_but_not_the_rest(tmp_path):
    out = tmp_path / "gc"
    r = run_check(out, "--device", "cpu", "--only", "env,bench,train",
                  env=dict(LIONCUB_GPU_CHECK_INJECT="env:error,bench:hang,train:error",
                           LIONCUB_GPU_CHECK_TIMEOUTS="env=600,train=600,bench=2"), timeout=1200)
    assert r.returncode == 1
    report = json.loads((out / "gpu-check.json").read_text())
    assert {k: v["status"] for k, v in report["steps"].items()} == dict(env="error", bench="timeout", train="error")
    assert "injected failure" in report["steps"]["env"]["error"]
    summary = (out / "summary.txt").read_text()
    assert "FAIL (0/3 steps passed)" in summary and "[timeout] 4 bench" in summary
    child = report["steps"]["bench"]["hang_child"]  # the hung step's own child died with it
    assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text().lower()


def test_no_python_with_torch_is_reported(tmp_path):
    bin_dir = tmp_path / "bin"  # the script's tools, and no Python
    bin_dir.mkdir()
    for tool in ("dirname", "mkdir", "tee"):
        (bin_dir / tool).symlink_to(subprocess.check_output(["bash", "-c", f"command -v {tool}"], text=True).strip())
    (tmp_path / "repo" / "scripts").mkdir(parents=True)  # a checkout without .venv
    script = tmp_path / "repo" / "scripts" / "gpu_check.sh"
    script.write_text((REPO / "scripts" / "gpu_check.sh").read_text())
    env = dict(os.environ, PYTHON="/nonexistent/python", PATH=str(bin_dir))
    r = subprocess.run(["/bin/bash", str(script), str(tmp_path / "gc")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "no Python with torch" in (tmp_path / "gc" / "summary.txt").read_text()


# --- pieces that matter on the GPU, on GPU-like data --------------------------------------------------------


def _bench_result(size, lion_ms, of_copy):
    big = 256 * 2**20
    kernels = [dict(size=s, kernel=k, ms=1.0, bytes=1, gbps=2500.0 * of_copy, of_copy=of_copy)
               for s in (size, big) for k in ("quantize_pack 1-bit", "unpack_apply 1-bit", "lion_step")]
    steps = [dict(size=s, lion_ms=lion_ms, **{"vote-1bit_ms": 1.2 * lion_ms, "l1-pbit_ms": 1.5 * lion_ms},
                  twin_lion_ms=3 * lion_ms, lion_pytorch_ms=1.1 * lion_ms) for s in (size, big)]
    return dict(copy_gbps=2500.0, device="NVIDIA H100 80GB HBM3", backend="triton", kernels=kernels, steps=steps,
                world_size=8, targets={"x": True})


def test_bench_summary_reads_the_bench_json():
    s = gpu_check._bench_summary(_bench_result(gpu_check.GPT2_124M_PARAMS, 2.0, 0.9), 64 * 2**20)
    assert s["min_codec_of_copy"] == 0.9 and len(s["codec_of_copy"]) == 4
    assert s["step_ratios"][256 * 2**20] == {"vote-1bit": 1.2, "l1-pbit": 1.5, "lion-pytorch / lion": 1.1,
                                              "twin lion / lion": 3.0}


def test_summary_lists_failed_checks_and_targets():
    results = dict(env=dict(status="pass", summary="NVIDIA H100; copy 2900 GB/s", checks={"a": True}),
                   tests=dict(status="fail", summary="3 failed", checks={"no failed test": False},
                              targets={"bit-identical": False, "85% of copy": True, "n/a one": None}))
    text = gpu_check.format_summary(results, "cuda", "full", 300.0)
    assert "NVIDIA H100" in text and "FAIL (1/2 steps passed)" in text and "targets: 1 of 3 met" in text
    assert "failed check: no failed test" in text and "[NOT met] bit-identical" in text and "rehearsal" not in text


def test_verbose_pytest_lines_are_counted_when_the_xml_is_missing():
    text = "\n".join(["tests/test_a.py::test_x[1] PASSED [ 10%]", "[gw1] [ 20%] FAILED tests/test_a.py::test_y",
                      "tests/test_a.py::test_z SKIPPED (no GPU) [ 30%]", "[gw0] [ 40%] PASSED tests/test_a.py::test_w"])
    c = gpu_check._verbose_counts(text)
    assert (c["tests"], c["passed"], c["failures"], c["skipped"]) == (4, 2, 1, 1) and c["partial"]
    assert c["failed_tests"] == [dict(test="tests/test_a.py::test_y", kind="failed")]


def test_gpt2_shapes_have_124m_parameters():
    assert sum(int(np.prod(s)) for s in gpu_check.gpt2_shapes(**gpu_check.GPT2_124M)) == gpu_check.GPT2_124M_PARAMS


def test_curve_diff():
    d = gpu_check._curve_diff([3.0, 2.0, 1.0, 1.0, 1.0], [3.0, 2.0, 1.5, 1.0, 1.0])
    assert not d["identical"] and d["first_different_step"] == 3 and d["max_abs_diff"] == 0.5
    assert gpu_check._curve_diff([1.0, 2.0], [1.0, 2.0])["identical"]


# --- the interpreter shim: an fp32 fma that rounds once ----------------------------------------------------


def _round_to_fp32(x: Fraction) -> np.float32:
    """The fp32 nearest to the exact rational x, ties to even (an oracle independent of the shim)."""
    f = np.float32(float(x))
    best = None
    for c in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))):
        if not np.isfinite(c):
            continue
        key = (abs(Fraction(float(c)) - x), int(np.array(c).view(np.int32)) & 1)
        if best is None or key < best[0]:
            best = (key, c)
    return best[1]


def test_fma_fp32_exact_rounds_once():
    from lioncub.kernels.triton_interpreter import fma_fp32_exact  # (triton_common must not be imported here)

    one = np.float32(1 + 2.0**-12)
    assert fma_fp32_exact(one, one, np.float32(-1))[()] == np.float32(2.0**-11 + 2.0**-24)  # x*y + z would give 2**-11
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)
    y = (rng.standard_normal(1000) * 10.0 ** rng.integers(-6, 6, 1000)).astype(np.float32)
    z = np.where(rng.random(1000) < 0.5, -(x.astype(np.float64) * y), rng.standard_normal(1000)).astype(np.float32)
    got = fma_fp32_exact(x, y, z)
    want = [_round_to_fp32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))) for a, b, c in zip(x, y, z)]
    assert np.array_equal(got, np.array(want, dtype=np.float32))
    special = np.array([np.inf, -np.inf, np.nan, 0.0], dtype=np.float32)
    assert np.isnan(fma_fp32_exact(special[0], np.float32(0), np.float32(1)))  # inf * 0
    assert fma_fp32_exact(special[0], np.float32(2), np.float32(1))[()] == np.inf
