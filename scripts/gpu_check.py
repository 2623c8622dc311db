"""`make gpu-check`: every CUDA check and benchmark of lioncub in one command, in under 6 minutes.

    bash scripts/gpu_check.sh OUTDIR [--size full|tiny] [--only env,cuda,...] [--device cuda|cpu]

The checks are pytest tests (marked `cuda`, and the kernel tests on LIONCUB_TEST_DEVICE=cuda), the benchmarks
scripts/gpu_bench.py. Around them: 1 env (the probe), 2 install (offline, from .whl/), 3 kernels and 4 cuda (pytest),
5 bench and 6 optimizer (gpu_bench.py), each with its limit out of one budget; OUTDIR/steps/NN-step.json and .log,
summary.txt and gpu-check.json after every step, gpu-check.tgz (all of it) at the end. Exit 1 when a check failed;
targets are reported. Without CUDA it rehearses on CPU tensors (Triton interpreter, tiny sizes; the `cuda` tests
with LIONCUB_TEST_DEVICE=cpu TRITON_INTERPRET=1). Imports only the standard library at the top: it runs before
lioncub is installed. See scripts/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = ("env", "install", "kernels", "cuda", "bench", "optimizer")
MIN_STEP_S = 10  # every later step keeps at least this much of the budget
KERNEL_TESTS = ["tests/kernels/test_kernels_triton.py", "tests/optim/test_optimizer_local.py",
                "tests/kernels/test_codecs.py", "tests/optim/test_backward_check.py"]
TINY_TESTS = ("(lion_step_matches_twin and default-tiles-2051) or (quantize_onebit and default-tiles-0-2051) or "
              "(quantize_fields and default-tiles-1001-l1-pbit-4) or (vote_counts and 8-13-True-default) or "
              "(unpack_apply_onebit and default-tiles-True-2051) or (unpack_apply_fields and default-tiles-1001-vote) "
              "or local_optimizer_triton_equals_torch or on_the_test_device_equal")
SIZES = {
    "full": dict(budget=345, limits=dict(env=15, install=25, kernels=70, cuda=110, bench=70, optimizer=40),
                 kernels=dict(files=KERNEL_TESTS, k=None), workers=12),
    "tiny": dict(budget=1200, limits=dict(env=60, install=120, kernels=300, cuda=400, bench=120, optimizer=180),
                 kernels=dict(files=KERNEL_TESTS[:1], k=TINY_TESTS), workers=0),
}


class Ctx:
    """One step: its time limit, its result (checks fail the run; targets are reported) and its files."""

    def __init__(self, out: Path, size: str, device: str, name: str, timeout: float):
        self.out, self.size, self.device, self.name, self.timeout = out, size, device, name, timeout
        self.cfg, self.cuda, self.t0, self.hit_limit = SIZES[size], device == "cuda", time.monotonic(), False
        self.stem = out / "steps" / f"{STEPS.index(name) + 1:02d}-{name}"
        self.result = dict(step=name, status="running", size=size, device=device, checks={}, targets={}, summary="",
                           started=datetime.datetime.now().isoformat(timespec="seconds"), limit_seconds=timeout)

    def left(self) -> float:
        return self.timeout - (time.monotonic() - self.t0)

    def check(self, name: str, ok) -> bool:  # a check fails the run; a target is reported
        self.result["checks"][name] = bool(ok)
        return bool(ok)

    def target(self, name: str, ok) -> None:
        self.result["targets"][name] = None if ok is None else bool(ok)

    def save(self) -> None:
        self.result["seconds"] = round(time.monotonic() - self.t0, 2)
        Path(f"{self.stem}.json").write_text(json.dumps(self.result, indent=2, default=str))

    def env(self, **extra) -> dict:
        """A child's environment: the Triton interpreter for CPU tensors, never on a GPU."""
        env = {k: v for k, v in dict(os.environ, PYTHONUNBUFFERED="1", **extra).items() if k != "TRITON_INTERPRET"}
        return env if self.cuda else dict(env, TRITON_INTERPRET="1")

    def run(self, cmd, env=None, timeout=None, cwd=REPO) -> dict:
        """cmd in a session of its own, logged to the step's log; on timeout all it started dies with it."""
        t0, timeout = time.monotonic(), max(1.0, self.left() - 2 if timeout is None else timeout)
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, timed_out = proc.communicate(timeout=timeout)[0], False
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            out, timed_out = proc.communicate()[0], True
            self.hit_limit = self.hit_limit or self.left() < 3  # the step's own limit, not a share of it
        with open(f"{self.stem}.log", "a") as f:
            f.write(f"$ {' '.join(map(str, cmd))}\n{out}\n[rc={proc.returncode} timed_out={timed_out}]\n")
        return dict(rc=proc.returncode, out=out or "", timed_out=timed_out, seconds=round(time.monotonic() - t0, 2))


def _kill_session(sid: int) -> None:
    """Kill every process of the session sid leads (pytest's workers, a bench, their own process groups)."""
    for pid in (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()):
        with contextlib.suppress(OSError):
            os.getsid(pid) == sid and os.kill(pid, signal.SIGKILL)


def _version(dist: str) -> str | None:
    with contextlib.suppress(metadata.PackageNotFoundError):  # (else None)
        return metadata.version(dist)


def _query(cmd: list) -> str:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    return ""


def step_env(ctx: Ctx) -> None:
    """The environment probe: what the machine has, and whether a GPU run can be a GPU run."""
    import platform
    import sysconfig

    import torch
    r, smi = ctx.result, shutil.which("nvidia-smi")
    r.update(python=sys.version.split()[0], executable=sys.executable, in_venv=sys.prefix != sys.base_prefix,
             platform=platform.platform(), cpus=os.cpu_count(), torch=torch.__version__, torch_cuda=torch.version.cuda,
             cuda_available=torch.cuda.is_available(), nvidia_smi=dict(present=smi is not None))
    if smi:
        fields = "name,driver_version,memory.total,clocks.max.sm,clocks.max.memory,power.limit,pstate,temperature.gpu"
        line = (_query([smi, f"--query-gpu={fields}", "--format=csv,noheader"]).splitlines() or [""])[0]
        m = re.search(r"CUDA Version:\s*([\d.]+)", _query([smi]))
        r["nvidia_smi"].update(zip(fields.split(","), (v.strip() for v in line.split(","))), cuda_version=m and m[1])
    try:
        import triton
        r["triton"] = triton.__version__
    except ImportError as exc:
        r["triton"], r["triton_error"] = None, str(exc)
    r["numpy"] = _version("numpy")
    r["packages"] = {d: _version(d) for d in ("pip", "setuptools", "wheel", "pytest", "pytest-xdist", "hypothesis",
                                              "simpy", "lion-pytorch", "tqdm", "matplotlib", "lioncub")}
    r["c_compiler"] = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    r["python_h"] = (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()
    ctx.check("torch imports", True)
    ctx.check("triton imports", r["triton"] is not None)
    # a machine with an NVIDIA driver must give torch a GPU: else the whole run would quietly be a rehearsal
    ctx.check("CUDA usable where an NVIDIA driver is present", r["cuda_available"] or not smi)
    if ctx.cuda:  # Triton builds its launcher with the machine's C compiler and Python's headers
        ctx.check("a C compiler and Python.h for Triton's launcher", bool(r["c_compiler"]) and r["python_h"])
        p = torch.cuda.get_device_properties(0)
        r["gpu"] = dict(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                        sms=p.multi_processor_count, count=torch.cuda.device_count())
    what = r["gpu"]["name"] if ctx.cuda else "CPU (rehearsal: no CUDA)"
    r["summary"] = (f"{what}; driver {r['nvidia_smi'].get('driver_version', '-')}; torch {r['torch']} (CUDA "
                    f"{r['torch_cuda']}), triton {r['triton']}, numpy {r['numpy']}, Python {r['python']}")


# import name -> distribution: what the checks need beyond torch, triton, numpy and pytest
NEEDED = dict(setuptools="setuptools", wheel="wheel", simpy="simpy", lion_pytorch="lion-pytorch", tqdm="tqdm")
OPTIONAL = {"xdist": "pytest-xdist", "execnet": "execnet"}


def _lioncub_location(ctx: Ctx) -> str | None:
    r = ctx.run([sys.executable, "-c", "import importlib.util as u; s = u.find_spec('lioncub.kernels'); "
                 "print(s.origin if s else '')"], timeout=60, cwd="/")
    return r["out"].strip().splitlines()[-1] if r["rc"] == 0 and r["out"].strip() else None


def _pip(ctx: Ctx, args) -> dict:
    """pip install with the network off; again with --break-system-packages on a PEP 668 system Python."""
    env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_ROOT_USER_ACTION="ignore")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *map(str, args)]
    r = ctx.run(cmd, env=env, timeout=max(5, ctx.left() - 5))
    if r["rc"] != 0 and "externally-managed-environment" in r["out"]:
        r = ctx.run(cmd[:4] + ["--break-system-packages"] + cmd[4:], env=env, timeout=max(5, ctx.left() - 5))
    return dict(cmd=" ".join(cmd), rc=r["rc"], seconds=r["seconds"], output=r["out"][-1500:])


def step_install(ctx: Ctx) -> None:
    r, wheels = ctx.result, sorted((REPO / ".whl").glob("*.whl"))
    wheel_for = {d: next((w for w in wheels if w.name.lower().startswith(d.replace("-", "_").lower() + "-")), None)
                 for d in {**NEEDED, **OPTIONAL}.values()}
    missing = {m: d for m, d in {**NEEDED, **OPTIONAL}.items() if importlib.util.find_spec(m) is None}
    major = re.match(r"\d*", _version("setuptools") or "").group()
    if "setuptools" not in missing and int(major or 0) < 68:  # pyproject's build requirement
        missing["setuptools"] = "setuptools"
    install = [wheel_for[d] for d in missing.values() if wheel_for[d]]
    r.update(wheels_available=[w.name for w in wheels], missing_before=sorted(missing.values()), pip=[],
             no_wheel=sorted(d for d in missing.values() if not wheel_for[d]))
    if install:
        r["pip"].append(_pip(ctx, install))
    mode = os.environ.get("LIONCUB_GPU_CHECK_INSTALL", "auto")  # auto | force | skip
    here = r["lioncub_before"] = _lioncub_location(ctx)
    if mode == "force" or (mode == "auto" and not (here and Path(here).resolve().is_relative_to(REPO))):
        r["pip"].append(_pip(ctx, ["--no-build-isolation", "-e", REPO]))
        r["lioncub_install"] = "installed (editable)"
    elif mode == "auto":  # installed from this checkout already (the rehearsal): prove the offline command works
        r["pip"].append(_pip(ctx, ["--no-build-isolation", "--dry-run", "-e", REPO]))
        r["lioncub_install"] = "already installed from this checkout; pip --dry-run of the same command"
    else:
        r["lioncub_install"] = "skipped (LIONCUB_GPU_CHECK_INSTALL=skip)"
    ctx.check("pip commands succeeded (no network)", all(p["rc"] == 0 for p in r["pip"]))
    mods = sorted({**NEEDED, **OPTIONAL})
    after = ctx.run([sys.executable, "-c", "import json, importlib.util as u; "
                     f"print(json.dumps({{m: u.find_spec(m) is not None for m in {mods!r}}}))"], timeout=60, cwd="/")
    present = r["present_after"] = json.loads(after["out"].strip().splitlines()[-1]) if after["rc"] == 0 else {}
    for mod in ("simpy", "lion_pytorch", "tqdm"):
        ctx.check(f"{NEEDED[mod]} importable", present.get(mod, False))
    loc = r["lioncub_after"] = _lioncub_location(ctx)
    ctx.check("lioncub.kernels importable from this checkout (outside it too)",
              loc is not None and Path(loc).resolve().is_relative_to(REPO))
    r["versions"] = {d: _version(d) for d in ("lioncub", *NEEDED.values(), *OPTIONAL.values())}
    r["summary"] = (f"lioncub: {r['lioncub_install']}; wheels installed: {', '.join(w.name for w in install) or 'none'}"
                    + (f"; no wheel for {', '.join(r['no_wheel'])}" if r["no_wheel"] else ""))


def verbose_counts(text: str) -> dict:
    """tests, passed, failures, errors, skipped and the failed tests, from `pytest -v` (also of a killed run)."""
    seen = {a or d: b or c for a, b, c, d in re.findall(r"(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)|"
                                                        r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (tests/\S+::\S+)",
                                                        text)}
    n = {k: sum(v == k for v in seen.values()) for k in ("FAILED", "ERROR", "SKIPPED")}
    return dict(tests=len(seen), failures=n["FAILED"], errors=n["ERROR"], skipped=n["SKIPPED"],
                passed=sum(v in ("PASSED", "XFAIL", "XPASS") for v in seen.values()), skip_reasons=sorted(set(
                    re.findall(r"^SKIPPED \[\d+\] \S+: (.*)$", text, re.M)))[:20],
                failed_tests=[dict(test=k, kind=v.lower()) for k, v in seen.items() if v in ("FAILED", "ERROR")][:30],
                outcomes=seen)


def _pytest(ctx: Ctx, args: list, **env) -> dict:
    """pytest -v (workers: pytest-xdist where present); the counts and the checks of any run."""
    workers = int(os.environ.get("LIONCUB_GPU_CHECK_TEST_WORKERS", ctx.cfg["workers"]))
    workers = min(workers, os.cpu_count() or 1) if importlib.util.find_spec("xdist") else 0
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfEs", *args] + ["-n", str(workers)] * (
        workers > 0)
    ctx.result.update(command=" ".join(cmd), workers=workers)
    ctx.save()
    run = ctx.run(cmd, env={k: v for k, v in ctx.env(LIONCUB_TEST_DEVICE=ctx.device, **env).items()
                            if k != "LIONCUB_KERNELS"})
    counts = ctx.result["counts"] = verbose_counts(run["out"])
    ctx.result.update(rc=run["rc"], timed_out=run["timed_out"], pytest_seconds=run["seconds"],
                      last_lines=run["out"].strip().splitlines()[-5:])
    ctx.check("pytest finished in time", not run["timed_out"])
    ctx.check("tests ran", counts.get("tests", 0) > 0)
    ctx.check("no failed or erroring test", run["rc"] == 0 and not counts.get("failures") and not counts.get("errors"))
    ctx.result["summary"] = (f"{counts.get('passed', 0)} passed, {counts.get('failures', 0) + counts.get('errors', 0)} "
                             f"failed, {counts.get('skipped', 0)} skipped on {ctx.device} ({run['seconds']:.0f} s, "
                             f"{workers or 1} worker(s))")
    return counts


def step_kernels(ctx: Ctx) -> None:
    """The kernel tests on the device; each twin comparison logs its mismatch count (LIONCUB_TEST_MISMATCH_LOG)."""
    cfg, mism = ctx.cfg["kernels"], Path(f"{ctx.stem}-mismatches.jsonl")  # (the runner removed the last run's)
    _pytest(ctx, [*cfg["files"], *(["-k", cfg["k"]] if cfg["k"] else [])], LIONCUB_TEST_MISMATCH_LOG=str(mism))
    rows = [json.loads(x) for x in mism.read_text().splitlines() if x.strip()] if mism.exists() else []
    twin = [x for x in rows if "first principles" not in x["what"]]
    m = ctx.result["mismatches"] = dict(
        comparisons=len(rows), twin_comparisons=len(twin), twin_mismatches=sum(x["mismatches"] for x in twin),
        unexplained=sum(not x["explained"] for x in rows), nonzero=sorted((x for x in rows if x["mismatches"]),
                                                                          key=lambda x: -x["mismatches"])[:20])
    ctx.check("every twin mismatch at a rounding boundary", m["unexplained"] == 0)
    ctx.target("Triton vs torch twins bit-identical (kernel tests)", m["twin_mismatches"] == 0 if rows else None)
    ctx.result["summary"] += (f"; kernel vs twin: {m['twin_mismatches']} mismatching elements in "
                              f"{m['twin_comparisons']} comparisons")


def step_cuda(ctx: Ctx) -> None:
    """`pytest -m cuda` on the files that hold them; the exactness figures they report become targets."""
    files = sorted(str(f.relative_to(REPO)) for f in REPO.glob("tests/**/test_*_cuda.py"))
    figures = Path(f"{ctx.stem}-figures.jsonl")
    ctx.result["files"] = files
    counts = _pytest(ctx, ["-m", "cuda", *files], LIONCUB_TEST_REPORT=str(figures), LIONCUB_GPU_CHECK_SIZE=ctx.size,
                     CUBLAS_WORKSPACE_CONFIG=":4096:8")  # deterministic cuBLAS: resumed runs compared bit for bit
    ctx.check("no cuda test skipped for want of a device", not any("needs CUDA" in x for x in counts["skip_reasons"]))
    rows = ctx.result["figures"] = [json.loads(x) for x in figures.read_text().splitlines()] if figures.exists() else []
    ctx.result["targets"].update({row["what"]: bool(row["target"]) for row in rows if "target" in row})
    ctx.result["summary"] += (f"; {sum(r.get('target') is True for r in rows)} of {sum('target' in r for r in rows)} "
                              "exactness figures bit-identical")


def _benchmark(ctx: Ctx, which: str, *args, **env) -> None:
    """scripts/gpu_bench.py WHICH: its figures, its checks (that it ran) and its targets."""
    out = Path(f"{ctx.stem}-figures.json")
    cmd = [sys.executable, REPO / "scripts" / "gpu_bench.py", which, out, "--device", ctx.device, "--size", ctx.size,
           "--seconds", max(1.0, ctx.left() - 10), *args]
    run = ctx.run(cmd, env=ctx.env(**env))
    if ctx.check(f"the {which} benchmark ran", run["rc"] == 0 and out.exists()):
        res = json.loads(out.read_text())
        ctx.result.update({k: v for k, v in res.items() if k not in ("checks", "targets")})
        ctx.result["checks"].update({k: bool(v) for k, v in res.get("checks", {}).items()})
        ctx.result["targets"].update({k: None if v is None else bool(v) for k, v in res.get("targets", {}).items()})
    else:
        ctx.result.update(error=run["out"][-3000:], summary=f"failed (rc {run['rc']}): see {ctx.stem.name}.log")


# 5 bench: `lioncub bench kernels --json`, fp32 and bf16; 6 optimizer: on the Triton kernels, the codec from step 5
STEP_FUNCS = dict(env=step_env, install=step_install, kernels=step_kernels, cuda=step_cuda,
                  bench=lambda ctx: _benchmark(ctx, "kernels", "--outdir", ctx.out / "steps"),
                  optimizer=lambda ctx: _benchmark(ctx, "optimizer", "--kernels-json", ctx.out / "steps" /
                                                   "05-bench-float32.json", LIONCUB_KERNELS="triton"))


def run_step(ctx: Ctx) -> dict:
    """Run one step; an exception is the step's error (LIONCUB_GPU_CHECK_INJECT=step:error|hang rehearses both)."""
    r = ctx.result
    try:
        ctx.save()
        inject = dict(x.split(":", 1) for x in os.environ.get("LIONCUB_GPU_CHECK_INJECT", "").split(",") if ":" in x)
        if inject.get(ctx.name) == "error":
            raise RuntimeError("injected failure (LIONCUB_GPU_CHECK_INJECT)")
        if inject.get(ctx.name) == "hang":  # a child in a process group of its own, as pytest's workers
            run = ctx.run([sys.executable, "-c", "import os, subprocess, time; c = subprocess.Popen(['sleep', "
                           "'9999'], preexec_fn=os.setpgrp); print('child', c.pid, flush=True); time.sleep(9999)"])
            r["hang_child"] = int(re.search(r"child (\d+)", run["out"]).group(1))
        else:
            STEP_FUNCS[ctx.name](ctx)
        if ctx.hit_limit:
            r["status"], r["summary"] = "timeout", f"timed out after {ctx.timeout:.0f} s; " + r.get("summary", "")
        else:
            r["status"] = "pass" if r["checks"] and all(r["checks"].values()) else "fail"
    except Exception as exc:  # noqa: BLE001 - the runner goes on with the next step
        r.update(status="error", error=traceback.format_exc()[-4000:], summary=r.get("summary") or f"error: {exc!r}")
    ctx.save()
    return r


def orchestrate(out: Path, size: str | None, only: list[str] | None, device: str | None) -> int:
    import torch
    (out / "steps").mkdir(parents=True, exist_ok=True)
    t_start, device = time.monotonic(), device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = size or os.environ.get("LIONCUB_GPU_CHECK_SIZE") or ("full" if device == "cuda" else "tiny")
    # LIONCUB_GPU_CHECK_TIMEOUTS="kernels=150,bench=120": limits that override the size's and the budget's
    overrides = {k.strip(): float(v) for k, v in (x.split("=") for x in
                 filter(None, os.environ.get("LIONCUB_GPU_CHECK_TIMEOUTS", "").split(",")))}
    todo = [s for s in STEPS if not only or s in only]
    print(f"lioncub gpu-check: {device}, size {size}, steps {', '.join(todo)} -> {out}", flush=True)
    results: dict = {}
    for i, name in enumerate(todo):
        left = SIZES[size]["budget"] - (time.monotonic() - t_start) - MIN_STEP_S * (len(todo) - i - 1)
        timeout = overrides.get(name) or max(MIN_STEP_S, min(SIZES[size]["limits"][name], left))
        print(f"[{STEPS.index(name) + 1}/{len(STEPS)}] {name} (limit {timeout:.0f} s) ...", end=" ", flush=True)
        ctx = Ctx(out, size, device, name, timeout)
        for f in ctx.stem.parent.glob(f"{ctx.stem.name}*"):
            f.unlink()
        results[name] = run_step(ctx)
        print(f"{results[name]['status']} ({results[name]['seconds']:.0f} s)", flush=True)
        summary = write_reports(out, results, device, size, time.monotonic() - t_start, todo)  # what we have so far
    with tarfile.open(out / "gpu-check.tgz", "w:gz") as tar:  # one archive of everything, for the device tool
        for f in ("summary.txt", "gpu-check.json", "steps"):
            tar.add(out / f, arcname=f"gpu-check/{f}")
    print(summary + f"(all files: {out / 'gpu-check.tgz'})", flush=True)
    return 0 if passed(results) else 1


def write_reports(out: Path, results: dict, device: str, size: str, seconds: float, todo: list) -> str:
    done = len(results) == len(todo)
    summary = format_summary(results, device, size, seconds) + ("" if done else f"\n(partial: {len(results)} of "
                                                                              f"{len(todo)} steps so far)\n")
    (out / "summary.txt").write_text(summary)
    (out / "gpu-check.json").write_text(json.dumps(dict(
        device=device, size=size, seconds=round(seconds, 1), date=datetime.date.today().isoformat(),
        status=("pass" if passed(results) else "fail") if done else "partial", steps=results), indent=2, default=str))
    return summary


def passed(results: dict) -> bool:  # every step that ran passed
    return bool(results) and all(r.get("status") == "pass" for r in results.values())


def format_summary(results: dict, device: str, size: str, seconds: float) -> str:
    env = results.get("env", {})
    head = env.get("summary") if env.get("status") == "pass" else f"device {device}"
    targets = {k: v for r in results.values() for k, v in r.get("targets", {}).items()}
    n_ok, met = sum(r.get("status") == "pass" for r in results.values()), sum(v is True for v in targets.values())
    lines = [f"lioncub gpu-check {datetime.date.today().isoformat()}: {head}",
             f"size {size}, {seconds:.0f} s: {'PASS' if passed(results) else 'FAIL'} ({n_ok}/{len(results)} steps "
             f"passed); targets: {met} of {len(targets)} met", ""]
    for name, r in results.items():
        lines.append(f"[{r.get('status', '?'):7s}] {STEPS.index(name) + 1} {name:9s} {r.get('summary', '')}")
        lines += [f"            failed check: {c}" for c, ok in r.get("checks", {}).items() if not ok]
        lines += [f"            failed test: {t['test']}" for t in r.get("counts", {}).get("failed_tests", [])]
    if targets:
        lines += ["", "targets (speed and exactness; reported, they do not fail the run):"]
        lines += [f"  [{'met' if v else 'n/a' if v is None else 'NOT met'}] {k}" for k, v in targets.items()]
    if device != "cuda":
        lines += ["", "no CUDA here: a rehearsal on CPU tensors (Triton interpreter, tiny sizes); the speed figures "
                      "are not meaningful and the GPU targets are not evaluated."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--size", choices=tuple(SIZES), help="default: full on a GPU, else tiny; LIONCUB_GPU_CHECK_SIZE")
    ap.add_argument("--only", help=f"comma-separated steps to run, of {','.join(STEPS)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if torch sees a GPU")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    if only and set(only) - set(STEPS):
        ap.error(f"unknown steps {sorted(set(only) - set(STEPS))}; choose from {', '.join(STEPS)}")
    return orchestrate(args.outdir.resolve(), args.size, only, args.device)


if __name__ == "__main__":
    sys.exit(main())
