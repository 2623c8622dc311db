"""`make gpu-check` rehearsed without a GPU: the whole runner on CPU tensors (Triton interpreter, tiny sizes), the
`cuda` tests included (LIONCUB_TEST_DEVICE=cpu), its failure handling, and the pieces that only matter on a GPU,
fed with GPU-like data. The checks themselves are the tests marked `cuda` (tests/**/test_*_cuda.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from fractions import Fraction
from pathlib import Path

import cuda_cases
import numpy as np
import pytest
from repo import REPO

from lioncub import methods

sys.path.insert(0, str(REPO / "scripts"))
import gpu_bench  # noqa: E402  (operations scripts, importable from scripts/)
import gpu_check  # noqa: E402

# the rehearsal checks what each step does, not how fast: on a busy machine every step gets ample time (the
# limits of a GPU run are the script's own; the subprocess timeout only guards against a hang)
REHEARSAL_LIMITS = ",".join(f"{step}=900" for step in gpu_check.STEPS)
# every test marked `cuda`, by function: each ran and passed in the rehearsal (one is CUDA's alone)
CUDA_TESTS = {
    "test_kernels_cuda.py": ["test_first_launch_lion_step_agrees_with_its_twin"],
    "test_step_cuda.py": ["test_gpt2_shaped_steps_on_the_triton_kernels",
                          "test_a_nan_gradient_is_skipped_on_the_device_and_counted",
                          "test_the_check_taken_in_backward_is_used_by_every_step[accumulate]",
                          "test_the_check_taken_in_backward_is_used_by_every_step[computing]"],
    "test_ranks_cuda.py": ["test_every_method_keeps_the_replicas_identical_on_the_device[2]"],
    "test_train_cuda.py": ["test_triton_and_the_twins_train_the_same_loss_curve"],
    "test_nccl_cuda.py": ["test_init_distributed_chooses_nccl_on_the_gpu",
                          "test_every_methods_exchange_equals_the_cpu_twins_on_gloo",
                          "test_every_method_layout_and_overlap_steps_the_same",
                          "test_attach_ddp_trains_as_lioncub_alone",
                          "test_grad_scaler_skips_the_overflowing_step_and_halves_the_scale[allreduce]",
                          "test_grad_scaler_skips_the_overflowing_step_and_halves_the_scale[vote-1bit]",
                          "test_checkpoint_resumed_run_equals_the_uninterrupted_one"],
}
CUDA_ONLY = {"tests/optim/test_step_cuda.py::test_step_makes_no_host_sync"}


def run_check(out, *args, env=None, timeout=3600):
    env = dict(os.environ, PYTHON=sys.executable, **{"LIONCUB_GPU_CHECK_TIMEOUTS": REHEARSAL_LIMITS, **(env or {})})
    for k in ("LIONCUB_GPU_CHECK_SIZE", "LIONCUB_KERNELS", "TRITON_INTERPRET", "LIONCUB_TEST_DEVICE"):
        env.pop(k, None)
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_rehearsal_runs_every_step_and_writes_json_summary_and_archive(tmp_path):
    r = run_check(tmp_path / "gc", "--device", "cpu")
    out = tmp_path / "gc"
    summary = (out / "summary.txt").read_text()
    assert r.returncode == 0, summary + r.stdout[-3000:] + r.stderr[-3000:]
    assert f"PASS ({len(gpu_check.STEPS)}/{len(gpu_check.STEPS)} steps passed)" in summary and "rehearsal" in summary
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["status"] == "pass" and report["device"] == "cpu" and report["size"] == "tiny"
    steps = {name: json.loads((out / "steps" / f"{i:02d}-{name}.json").read_text())
             for i, name in enumerate(gpu_check.STEPS, 1)}
    for name, s in steps.items():
        assert s["status"] == "pass" and s["checks"] and all(s["checks"].values()), (name, s["checks"])
        assert s["summary"], name
    with tarfile.open(out / "gpu-check.tgz") as tar:  # everything in one archive, for the device tool
        names = set(tar.getnames())
    assert {"gpu-check/summary.txt", "gpu-check/gpu-check.json", "gpu-check/steps/04-cuda.json"} <= names
    assert steps["env"]["torch"] and steps["env"]["cuda_available"] is False
    kernels = steps["kernels"]
    assert kernels["counts"]["passed"] >= 10 and kernels["mismatches"]["comparisons"] > 0
    assert kernels["mismatches"]["twin_mismatches"] == 0  # the interpreter reproduces the twins exactly
    cuda = steps["cuda"]  # every test marked `cuda` ran on CPU tensors and passed; only the CUDA-only one skipped
    ran = {k for k, v in cuda["counts"]["outcomes"].items() if v == "PASSED"}
    want = {f"{f}::{t}" for f, tests in CUDA_TESTS.items() for t in tests}
    assert want <= {k.split("/")[-1] for k in ran}, want - {k.split("/")[-1] for k in ran}
    assert {k for k, v in cuda["counts"]["outcomes"].items() if v != "PASSED"} == CUDA_ONLY
    assert cuda["targets"] and all(cuda["targets"].values()), cuda["targets"]  # bit-identical in the rehearsal
    assert any("Triton and torch twins give the same parameters" in k for k in cuda["targets"])
    assert any("bit-identical" in k and "training" in k for k in cuda["targets"])
    exchanges = next(f for f in cuda["figures"] if f["what"].startswith("exchange mismatches"))["mismatches"]
    assert set(exchanges) == {f"{m} ({g})" for m in methods.NAMES for g in ("default group", "subgroup")}
    assert steps["bench"]["runs"]["float32"]["copy_gbps"] > 0
    opt = steps["optimizer"]
    assert opt["copy"]["gbps"] > 0 and opt["copy"]["meaningful"] is False
    assert set(opt["step_ms"]) >= {"lioncub", "lioncub, no finite check", "torch AdamW(fused=True)"}
    assert opt["backend"] == "lioncub.kernels.triton_ops"
    cb = opt["check_in_backward"]
    assert set(cb["ms"]) == {"check in backward", "no check"}
    assert set(cb["computing_backward"]["ms"]["no check"]) == {"backward", "step", "iteration"}
    assert isinstance(opt["codec"], str) and opt["targets"] == {}  # no 124M bucket at tiny sizes; no GPU targets


def test_a_failed_or_hung_step_fails_the_run_but_not_the_rest(tmp_path):
    out = tmp_path / "gc"
    r = run_check(out, "--device", "cpu", "--only", "env,kernels,bench",
                  env=dict(LIONCUB_GPU_CHECK_INJECT="env:error,bench:hang,kernels:error",
                           LIONCUB_GPU_CHECK_TIMEOUTS="env=600,kernels=600,bench=3"), timeout=1200)
    assert r.returncode == 1
    report = json.loads((out / "gpu-check.json").read_text())
    assert {k: v["status"] for k, v in report["steps"].items()} == dict(env="error", kernels="error", bench="timeout")
    assert "injected failure" in report["steps"]["env"]["error"]
    summary = (out / "summary.txt").read_text()
    assert "FAIL (0/3 steps passed)" in summary and "[timeout] 5 bench" in summary
    child = report["steps"]["bench"]["hang_child"]  # the hung step's own child died with it
    assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text().lower()
    assert (out / "gpu-check.tgz").exists()


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


def test_the_cuda_tests_are_where_the_runner_looks_and_all_marked():
    files = sorted(REPO.glob("tests/**/test_*_cuda.py"))
    assert {f.name for f in files} == set(CUDA_TESTS)
    assert all("pytestmark = pytest.mark.cuda" in f.read_text() for f in files)


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
    s = gpu_bench.bench_summary(_bench_result(cuda_cases.GPT2_124M_PARAMS, 2.0, 0.9), 64 * 2**20)
    assert s["min_codec_of_copy"] == 0.9 and len(s["codec_of_copy"]) == 4
    assert s["step_ratios"][256 * 2**20] == {"vote-1bit": 1.2, "l1-pbit": 1.5, "lion-pytorch / lion": 1.1,
                                              "twin lion / lion": 3.0}


def test_codec_of_the_bench_on_the_gpt2_bucket(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_bench_result(cuda_cases.GPT2_124M_PARAMS, 2.0, 0.9)))
    c = gpu_bench.codec_of_bench(path, cuda_cases.GPT2_124M_PARAMS)
    assert c["x_lion"]["vote-1bit"] == 1.2 and c["x_lion"]["l1-pbit"] == 1.5 and c["world_size"] == 8
    assert isinstance(gpu_bench.codec_of_bench(path, 1000), str)


def test_summary_lists_failed_checks_tests_and_targets():
    results = dict(env=dict(status="pass", summary="NVIDIA H100; driver 570", checks={"a": True}),
                   kernels=dict(status="fail", summary="3 failed", checks={"no failed test": False},
                                counts=dict(failed_tests=[dict(test="tests/t.py::test_x", kind="failed")]),
                                targets={"bit-identical": False, "85% of copy": True, "n/a one": None}))
    text = gpu_check.format_summary(results, "cuda", "full", 300.0)
    assert "NVIDIA H100" in text and "FAIL (1/2 steps passed)" in text and "targets: 1 of 3 met" in text
    assert "failed check: no failed test" in text and "failed test: tests/t.py::test_x" in text
    assert "[NOT met] bit-identical" in text and "rehearsal" not in text


def test_verbose_pytest_lines_are_counted():
    text = "\n".join(["tests/test_a.py::test_x[1] PASSED [ 10%]", "[gw1] [ 20%] FAILED tests/test_a.py::test_y",
                      "tests/test_a.py::test_z SKIPPED (no GPU) [ 30%]", "[gw0] [ 40%] PASSED tests/test_a.py::test_w",
                      "SKIPPED [1] tests/test_a.py:12: needs CUDA (torch.cuda.is_available() is False)",
                      "FAILED tests/test_a.py::test_y - AssertionError"])
    c = gpu_check.verbose_counts(text)
    assert (c["tests"], c["passed"], c["failures"], c["skipped"]) == (4, 2, 1, 1)
    assert c["failed_tests"] == [dict(test="tests/test_a.py::test_y", kind="failed")]
    assert c["skip_reasons"] == ["needs CUDA (torch.cuda.is_available() is False)"]


def test_gpt2_shapes_have_124m_parameters():
    for shapes in (gpu_bench.gpt2_shapes(**gpu_bench.GPT2["full"]), cuda_cases.gpt2_shapes(**cuda_cases.GPT2_124M)):
        assert sum(int(np.prod(s)) for s in shapes) == cuda_cases.GPT2_124M_PARAMS


def test_curve_diff():
    d = cuda_cases.curve_diff([3.0, 2.0, 1.0, 1.0, 1.0], [3.0, 2.0, 1.5, 1.0, 1.0])
    assert not d["identical"] and d["first_different_step"] == 3 and d["max_abs_diff"] == 0.5
    assert cuda_cases.curve_diff([1.0, 2.0], [1.0, 2.0])["identical"]


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
