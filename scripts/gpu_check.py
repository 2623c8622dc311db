"""`make gpu-check`: every CUDA check and benchmark of lioncub in one command, in under 6 minutes.

    bash scripts/gpu_check.sh OUTDIR                      # or: make gpu-check OUT=OUTDIR
    python scripts/gpu_check.py OUTDIR [--size full|tiny] [--only env,bench,...]

Steps (each in its own process with its own time limit; a failed or timed-out step never stops the rest):

  1 env        GPU, driver, torch, triton, numpy; measured device-to-device copy bandwidth
  2 install    lioncub into this Python without the network (pip --no-index --no-deps --no-build-isolation
               -e .), plus the wheels in .whl/ for what this Python lacks (scripts/fetch_gpu_wheels.sh)
  3 tests      the kernel and optimizer tests on the device (LIONCUB_TEST_DEVICE=cuda): every Triton kernel
               against its torch twin, fp32/bf16/fp16; and how many rounding-level mismatches there were
  4 bench      `lioncub bench kernels --json`, fp32 and bf16: GB/s against the copy bandwidth of the run
  5 optimizer  a GPT-2-124M-shaped parameter set, world size 1: LionCub against lion-pytorch's Triton Lion
               and torch's fused AdamW; the vote-1bit codec against the fused Lion step (from step 4)
  6 ranks      LionCub on device tensors, 2 and 4 Gloo processes sharing the GPU, every method: replicas
               identical after 20 steps, on the Triton kernels and on the torch twins
  7 train      200 steps of char-medium on one GPU with LIONCUB_KERNELS=triton and =torch (and a second
               Triton run as a determinism control): the same loss curve
  8 nccl       one process, `lioncub.init_distributed()` as under torchrun at world size 1: NCCL on the GPU.
               Every method's collectives (default group and a subgroup) against the CPU twins on Gloo; LionCub
               with every method, flat and hierarchical, overlap on and off; attach_ddp on a DDP model;
               GradScaler("cuda") with fp16 autocast; lioncub.checkpoint save/load

Each step writes OUTDIR/NN-step.json (status, checks, targets, figures) and its log OUTDIR/NN-step.log;
at the end OUTDIR/gpu-check.json holds everything and OUTDIR/summary.txt a short summary. The exit status is
non-zero when any check failed (a crash, a timeout, a wrong result); the speed targets are reported, met or
not, and do not change it.

Without CUDA (the rehearsal, in CI) the same steps run on CPU tensors with the Triton interpreter
(TRITON_INTERPRET=1) and tiny sizes; `--size tiny` (or LIONCUB_GPU_CHECK_SIZE=tiny) also gives a
one-minute smoke run on a GPU. This script imports only the standard library at the top: it runs before
lioncub is installed. It is an operations script, not part of the library (`gpu_check` is importable from
scripts/, which is how its spawned ranks and step processes find it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
STEPS = ("env", "install", "tests", "bench", "optimizer", "ranks", "train", "nccl")
BUDGET_S = 345  # the whole run, all steps: < 6 minutes with the start-up and the summary
MIN_STEP_S = 10  # every later step keeps at least this much of the budget

GPT2_124M = dict(n_layer=12, d=768, vocab=50257, ctx=1024)
GPT2_124M_PARAMS = 124_439_808
TEST_FILES = ["tests/kernels/test_kernels_triton.py", "tests/optim/test_optimizer_local.py",
              "tests/kernels/test_codecs.py", "tests/optim/test_backward_check.py"]
TINY_TESTS = ("(lion_step_matches_twin and default-tiles-2051) or (quantize_onebit and default-tiles-0-2051) or "
              "(quantize_fields and default-tiles-1001-l1-pbit-4) or (vote_counts and 8-13-True-default) or "
              "(unpack_apply_onebit and default-tiles-True-2051) or (unpack_apply_fields and default-tiles-1001-vote) "
              "or local_optimizer_triton_equals_torch or on_the_test_device_equal")
LIONCUB_CLI = "import sys; from lioncub.cli import main; sys.exit(main(sys.argv[1:]))"  # the `lioncub` command

SIZES = {
    "full": dict(
        timeouts=dict(env=15, install=25, tests=70, bench=70, optimizer=25, ranks=65, train=35, nccl=40),
        copy_bytes=1 << 30,
        tests=dict(files=TEST_FILES, k=None, workers=12),
        # --repeat 5: 50 ms of timed runs per figure (triton.testing.do_bench, medians). The bench makes its
        # buffers with CPU randn (twice per size: Triton and twins), about half of its time at 256M
        bench=[dict(dtype="float32", sizes=f"1M,4M,16M,64M,{GPT2_124M_PARAMS},256M", share=0.62, repeat=5),
               dict(dtype="bfloat16", sizes="64M,256M", share=0.38, repeat=5)],
        gpt2=GPT2_124M, opt_steps=10, opt_rounds=5, busy_dim=1024,
        ranks=dict(world_sizes=[2, 4], steps=20, sync_every=7, shapes=[(1000, 257), (4097,), (3, 333), (65537,)],
                   bf16=[(511, 129)], fp16=[(70001,)], bucket_mb=0.5),
        train=dict(model="char-medium", steps=200, batch_size=32, block_size=128, eval_batches=4),
    ),
    "tiny": dict(
        timeouts=dict(env=30, install=60, tests=90, bench=60, optimizer=60, ranks=90, train=90, nccl=90),
        copy_bytes=16 << 20,
        tests=dict(files=["tests/kernels/test_kernels_triton.py"], k=TINY_TESTS, workers=0),
        bench=[dict(dtype="float32", sizes="64K", share=1.0, repeat=1)],
        gpt2=dict(n_layer=1, d=32, vocab=256, ctx=64), opt_steps=2, opt_rounds=2, busy_dim=32,
        ranks=dict(world_sizes=[2], steps=3, sync_every=2, shapes=[(37, 5), (300,)], bf16=[(7, 3)], fp16=[(11,)],
                   bucket_mb=1024 / 2**20),
        train=dict(model="char-tiny", steps=3, batch_size=4, block_size=16, eval_batches=1),
    ),
}
SIZES["full"]["budget"] = BUDGET_S
SIZES["tiny"]["budget"] = 600


# --- the context of one step -----------------------------------------------------------------------------


class Ctx:
    def __init__(self, out: Path, size: str, device: str, name: str, timeout: float):
        self.out, self.size, self.device, self.name, self.timeout = out, size, device, name, timeout
        self.cfg = SIZES[size]
        self.cuda = device == "cuda"
        self.t0 = time.monotonic()
        self.result = dict(step=name, status="running", size=size, device=device, checks={}, targets={},
                           summary="", started=datetime.datetime.now().isoformat(timespec="seconds"))

    @property
    def path(self) -> Path:
        return self.out / f"{STEPS.index(self.name) + 1:02d}-{self.name}.json"

    def left(self) -> float:
        return self.timeout - (time.monotonic() - self.t0)

    def check(self, name: str, ok: bool) -> bool:
        self.result["checks"][name] = bool(ok)
        return bool(ok)

    def target(self, name: str, ok: bool | None) -> None:
        self.result["targets"][name] = None if ok is None else bool(ok)

    def save(self) -> None:
        self.result["seconds"] = round(time.monotonic() - self.t0, 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=2, default=str))
        os.replace(tmp, self.path)

    def env(self, **extra) -> dict:
        """The environment for a child process: the interpreter for Triton on CPU tensors."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
        if self.cuda:
            env.pop("TRITON_INTERPRET", None)
        else:
            env["TRITON_INTERPRET"] = "1"
        return env


def run_cmd(cmd, timeout, env=None, cwd=REPO, log=None, session=False) -> dict:
    """Run a command in its own process group (session=True: its own session, for a step: on timeout all
    that the step started dies with it); kill it on timeout. Returns rc, output, seconds."""
    t0 = time.monotonic()
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=session,
                            preexec_fn=None if session else os.setpgrp)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        timed_out = False
    except subprocess.TimeoutExpired:
        (_kill_session if session else _kill_group)(proc)
        out, _ = proc.communicate()
        timed_out = True
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(str(c) for c in cmd)}\n{out}\n[rc={proc.returncode} timed_out={timed_out}]\n")
    return dict(rc=proc.returncode, out=out or "", timed_out=timed_out, seconds=round(time.monotonic() - t0, 2))


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _kill_session(proc) -> None:
    """Kill every process of the session that proc leads (its children run in process groups of their own)."""
    sid = proc.pid
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass
    _kill_group(proc)


def tail(text: str, n: int = 3000) -> str:
    return text[-n:]


# --- 1 env ----------------------------------------------------------------------------------------------


def copy_bandwidth(torch, device, nbytes: int, repeat: int = 20) -> dict:
    """dst.copy_(src) of nbytes: GB/s counting the bytes read and written (2 * nbytes per copy)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    dst.copy_(src)
    sync()
    repeat = max(1, min(repeat, int(0.05 / max(time.perf_counter() - t, 1e-6))))  # about 50 ms per round
    times = []
    for _ in range(5):
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(repeat):
                dst.copy_(src)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3 / repeat)
        else:
            t = time.perf_counter()
            for _ in range(repeat):
                dst.copy_(src)
            times.append((time.perf_counter() - t) / repeat)
    best = sorted(times)[len(times) // 2]
    return dict(bytes=nbytes, seconds=best, gbps=2 * nbytes / best / 1e9)


def _version(dist: str):
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> dict:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return dict(present=False)
    info = dict(present=True)
    for fields in ("name,driver_version,memory.total",
                   "clocks.max.sm,clocks.max.memory,power.limit,pstate,temperature.gpu"):
        r = run_cmd([exe, f"--query-gpu={fields}", "--format=csv,noheader"], 20)
        if r["rc"] == 0 and r["out"].strip():
            info.update(zip(fields.split(","), (v.strip() for v in r["out"].strip().splitlines()[0].split(","))))
        else:
            info[f"error ({fields})"] = tail(r["out"], 300)
    head = run_cmd([exe], 20)
    info["cuda_version"] = next((line.split("CUDA Version:")[1].strip(" |") for line in head["out"].splitlines()
                                 if "CUDA Version:" in line), None)
    return info


def step_env(ctx: Ctx) -> None:
    import platform

    import torch
    r = ctx.result
    r.update(python=sys.version.split()[0], executable=sys.executable, prefix=sys.prefix,
             in_venv=sys.prefix != sys.base_prefix, platform=platform.platform(), cpus=os.cpu_count(),
             torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
             nvidia_smi=_nvidia_smi())
    try:
        import triton
        r["triton"] = triton.__version__
    except ImportError as exc:
        r["triton"] = None
        r["triton_error"] = str(exc)
    import numpy
    r["numpy"] = numpy.__version__
    r["packages"] = {d: _version(d) for d in ("pip", "setuptools", "wheel", "pytest", "pytest-xdist", "hypothesis",
                                              "simpy", "lion-pytorch", "tqdm", "matplotlib", "lioncub")}
    import sysconfig
    r["c_compiler"] = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    r["python_h"] = (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()
    ctx.check("torch imports", True)
    ctx.check("triton imports", r["triton"] is not None)
    # a machine with an NVIDIA driver must give torch a GPU: else the whole run would quietly be a rehearsal
    ctx.check("CUDA usable where an NVIDIA driver is present", r["cuda_available"] or not r["nvidia_smi"]["present"])
    device = torch.device("cuda" if ctx.cuda else "cpu")
    if ctx.cuda:  # Triton builds its launcher with the machine's C compiler and Python's headers
        ctx.check("a C compiler and Python.h for Triton's launcher", bool(r["c_compiler"]) and r["python_h"])
        p = torch.cuda.get_device_properties(0)
        r["gpu"] = dict(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                        sms=p.multi_processor_count, count=torch.cuda.device_count())
    ctx.save()
    r["copy"] = copy_bandwidth(torch, device, ctx.cfg["copy_bytes"])
    r["copy"]["meaningful"] = ctx.cuda
    ctx.check("copy bandwidth measured", r["copy"]["gbps"] > 0)
    what = r["gpu"]["name"] if ctx.cuda else "CPU (rehearsal: no CUDA)"
    r["summary"] = (f"{what}; driver {r['nvidia_smi'].get('driver_version', '-')}; torch {r['torch']} "
                    f"(CUDA {r['torch_cuda']}), triton {r['triton']}, numpy {r['numpy']}, Python {r['python']}; "
                    f"copy {r['copy']['gbps']:.0f} GB/s ({r['copy']['bytes'] >> 20} MiB "
                    f"{'device-to-device' if ctx.cuda else 'host memory, not meaningful'})")


# --- 2 install --------------------------------------------------------------------------------------------

# import name -> distribution; what the check needs from this Python beyond torch, triton, numpy and pytest
NEEDED = {"setuptools": "setuptools", "wheel": "wheel", "simpy": "simpy", "lion_pytorch": "lion-pytorch",
          "tqdm": "tqdm"}
OPTIONAL = {"xdist": "pytest-xdist", "execnet": "execnet"}


def _older(version: str | None, minimum: tuple) -> bool:
    parts = []
    for x in (version or "0").split(".")[: len(minimum)]:
        digits = "".join(c for c in x if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) < minimum


def _wheel_for(dist: str, wheels) -> Path | None:
    stem = dist.replace("-", "_").lower() + "-"
    return next((w for w in wheels if w.name.lower().startswith(stem)), None)


def _lioncub_location(py: str) -> str | None:
    r = run_cmd([py, "-c", "import importlib.util as u; s = u.find_spec('lioncub.kernels'); "
                           "print(s.origin if s else '')"], 60, cwd="/")
    return r["out"].strip().splitlines()[-1] if r["rc"] == 0 and r["out"].strip() else None


def _pip(ctx: Ctx, args, log) -> dict:
    """pip install with the network off; retried with --break-system-packages on an externally managed
    (PEP 668) system Python."""
    env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_ROOT_USER_ACTION="ignore")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *args]
    r = run_cmd(cmd, max(5, ctx.left() - 5), env=env, log=log)
    if r["rc"] != 0 and "externally-managed-environment" in r["out"]:
        r = run_cmd(cmd[:4] + ["--break-system-packages"] + cmd[4:], max(5, ctx.left() - 5), env=env, log=log)
    return dict(cmd=" ".join(cmd), rc=r["rc"], seconds=r["seconds"], output=tail(r["out"], 1500))


# the first Triton launch on the device: lion_step on 1M + 3 elements, against the torch twin
SMOKE = """
import sys, time, torch
from lioncub.kernels import reference, triton_ops
import lioncub.optim, lioncub.apps.train.loop
dev = torch.device(sys.argv[1]); n = (1 << 20) + 3 if dev.type == "cuda" else 4099
gen = torch.Generator().manual_seed(0)
p, g, m = (torch.randn(n, generator=gen).to(dev) for _ in range(3))
a, b = (p.clone(), m.clone()), (p.clone(), m.clone())
t = time.perf_counter()
triton_ops.lion_step(a[0], g, a[1], lr=1e-3, wd=0.1, beta1=0.9, beta2=0.99)
reference.lion_step(b[0], g, b[1], lr=1e-3, wd=0.1, beta1=0.9, beta2=0.99)
diff = int((a[0] != b[0]).sum()) + int((a[1] != b[1]).sum())
close = all(bool(torch.isfinite(x).all()) for x in a) and all(
    float(((x - y).abs() / y.abs().clamp_min(1e-3)).max()) < 1e-2 for x, y in zip(a, b))
print(f"first launch incl. compile {time.perf_counter() - t:.2f} s; {diff} of {2 * n} values differ from the twin")
assert close, "the Triton kernel's result is not the twin's"
print("smoke ok")
"""


def step_install(ctx: Ctx) -> None:
    import importlib.util

    r, log = ctx.result, ctx.out / "02-install.log"
    wheels = sorted((REPO / ".whl").glob("*.whl"))
    r["wheels_available"] = [w.name for w in wheels]
    missing = {mod: dist for mod, dist in {**NEEDED, **OPTIONAL}.items() if importlib.util.find_spec(mod) is None}
    if "setuptools" not in missing and _older(_version("setuptools"), (68,)):  # pyproject's build requirement
        missing["setuptools"] = "setuptools"
    r["missing_before"] = sorted(missing.values())
    install = [_wheel_for(d, wheels) for d in missing.values()]
    r["no_wheel"] = sorted(d for d in missing.values() if _wheel_for(d, wheels) is None)
    r["pip"] = []
    if any(install):
        r["pip"].append(_pip(ctx, [str(w) for w in install if w], log))
    mode = os.environ.get("LIONCUB_GPU_CHECK_INSTALL", "auto")  # auto | force | skip
    here = _lioncub_location(sys.executable)
    r["lioncub_before"] = here
    installed_here = here is not None and Path(here).resolve().is_relative_to(REPO)
    if mode == "force" or (mode == "auto" and not installed_here):
        r["pip"].append(_pip(ctx, ["--no-build-isolation", "-e", str(REPO)], log))
        r["lioncub_install"] = "installed (editable)"
    elif mode == "auto":  # installed from this checkout already (the rehearsal): prove the offline command works
        r["pip"].append(_pip(ctx, ["--no-build-isolation", "--dry-run", "-e", str(REPO)], log))
        r["lioncub_install"] = "already installed from this checkout; pip --dry-run of the same command"
    else:
        r["lioncub_install"] = "skipped (LIONCUB_GPU_CHECK_INSTALL=skip)"
    ctx.check("pip commands succeeded (no network)", all(p["rc"] == 0 for p in r["pip"]))
    mods = sorted({**NEEDED, **OPTIONAL})
    after = run_cmd([sys.executable, "-c", "import json, importlib.util as u; "
                     f"print(json.dumps({{m: u.find_spec(m) is not None for m in {mods!r}}}))"], 60, cwd="/")
    present = json.loads(after["out"].strip().splitlines()[-1]) if after["rc"] == 0 else {}
    r["present_after"] = present
    for mod in ("simpy", "lion_pytorch", "tqdm"):
        ctx.check(f"{NEEDED[mod]} importable", present.get(mod, False))
    r["lioncub_after"] = _lioncub_location(sys.executable)
    ctx.check("lioncub.kernels importable from this checkout (outside it too)", r["lioncub_after"] is not None and
              Path(r["lioncub_after"]).resolve().is_relative_to(REPO))
    probe = run_cmd([sys.executable, "-c", SMOKE, ctx.device], max(10, ctx.left() - 2), env=ctx.env())
    # exact equality is step 3's business (a target): here only that Triton compiles, launches and computes Lion
    ctx.check(f"a Triton kernel compiles, runs on {ctx.device} and agrees with its twin", probe["rc"] == 0 and
              probe["out"].strip().endswith("smoke ok"))
    r["smoke"] = tail(probe["out"], 1500)
    r["versions"] = {d: _version(d) for d in ("lioncub", *NEEDED.values(), *OPTIONAL.values())}
    r["summary"] = (f"lioncub: {r['lioncub_install']}; wheels installed: "
                    f"{', '.join(w.name for w in install if w) or 'none needed'}"
                    + (f"; no wheel for {', '.join(r['no_wheel'])}" if r["no_wheel"] else ""))


# --- 3 tests ---------------------------------------------------------------------------------------------


def _junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    failed = []
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
        for case in s.iter("testcase"):
            for kind in ("failure", "error"):
                el = case.find(kind)
                if el is not None:
                    failed.append(dict(test=f"{case.get('classname')}::{case.get('name')}", kind=kind,
                                       message=(el.get("message") or "")[:300]))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_tests"] = failed[:30]
    return counts


def _verbose_counts(text: str) -> dict:
    import re
    outcomes = re.findall(r"(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)|"
                          r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (tests/\S+::\S+)", text)
    seen = {}
    for a, b, c, d in outcomes:
        seen[a or d] = b or c
    counts = dict(tests=len(seen), failures=sum(v == "FAILED" for v in seen.values()),
                  errors=sum(v == "ERROR" for v in seen.values()), skipped=sum(v == "SKIPPED" for v in seen.values()))
    counts["passed"] = sum(v in ("PASSED", "XFAIL", "XPASS") for v in seen.values())
    counts["failed_tests"] = [dict(test=k, kind=v.lower()) for k, v in seen.items() if v in ("FAILED", "ERROR")][:30]
    counts["partial"] = True
    return counts


def _mismatch_report(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    twin = [r for r in rows if "first principles" not in r["what"]]
    worst = sorted((r for r in rows if r["mismatches"]), key=lambda r: -r["mismatches"])[:20]
    return dict(comparisons=len(rows), twin_comparisons=len(twin),
                twin_mismatches=sum(r["mismatches"] for r in twin),
                first_principles_mismatches=sum(r["mismatches"] for r in rows if r not in twin),
                unexplained=sum(1 for r in rows if not r["explained"]), nonzero=worst)


def step_tests(ctx: Ctx) -> None:
    r, cfg = ctx.result, ctx.cfg["tests"]
    xml, mism = ctx.out / "03-tests.xml", ctx.out / "03-mismatches.jsonl"
    for f in (xml, mism):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE", f"--junitxml={xml}", *cfg["files"]]
    if cfg["k"]:
        cmd += ["-k", cfg["k"]]
    import importlib.util
    workers = int(os.environ.get("LIONCUB_GPU_CHECK_TEST_WORKERS", cfg["workers"]))
    workers = workers if importlib.util.find_spec("xdist") else 0
    if workers:
        cmd += ["-n", str(min(workers, os.cpu_count() or 1))]
    r["command"] = " ".join(cmd)
    r["workers"] = workers
    env = ctx.env(LIONCUB_TEST_DEVICE=ctx.device, LIONCUB_TEST_MISMATCH_LOG=str(mism))
    env.pop("TRITON_INTERPRET", None)  # the test module sets it itself for CPU tensors
    env.pop("LIONCUB_KERNELS", None)
    ctx.save()
    run = run_cmd(cmd, ctx.left() - 3, env=env, log=ctx.out / "03-tests.log")
    r.update(rc=run["rc"], timed_out=run["timed_out"], pytest_seconds=run["seconds"],
             last_lines=run["out"].strip().splitlines()[-5:])
    counts = _junit_counts(xml) or _verbose_counts(run["out"])  # killed: no XML, count what -v printed
    r["counts"] = counts
    r["mismatches"] = m = _mismatch_report(mism)
    ctx.check("pytest finished in time", not run["timed_out"])
    ctx.check("tests ran", counts.get("tests", 0) > 0)
    ctx.check("no failed or erroring test", run["rc"] == 0 and not counts.get("failures") and not counts.get("errors"))
    ctx.check("every twin mismatch at a rounding boundary", m["unexplained"] == 0)
    ctx.target("Triton vs torch twins bit-identical (kernel tests)",
               m["twin_mismatches"] == 0 if m["comparisons"] else None)
    r["summary"] = (f"{counts.get('passed', 0)} passed, {counts.get('failures', 0) + counts.get('errors', 0)} failed, "
                    f"{counts.get('skipped', 0)} skipped on {ctx.device} ({run['seconds']:.0f} s, "
                    f"{workers or 1} worker(s)); kernel vs twin: {m['twin_mismatches']} mismatching elements in "
                    f"{m['twin_comparisons']} comparisons")


# --- 4 bench ---------------------------------------------------------------------------------------------


def _parse_json(text: str):
    start = text.find("{")
    return json.loads(text[start:]) if start >= 0 else None


def _bench_summary(res: dict, big: int) -> dict:
    rows = res.get("kernels", [])
    codec = [x for x in rows if x["kernel"].startswith(("quantize_pack", "unpack_apply")) and x["size"] >= big]
    steps = {s["size"]: s for s in res.get("steps", [])}
    out = dict(copy_gbps=res.get("copy_gbps"), device=res.get("device"), backend=res.get("backend"),
               min_codec_of_copy=min((x["of_copy"] for x in codec), default=None),
               codec_of_copy={f"{x['kernel']} @ {x['size']}": round(x["of_copy"], 3) for x in codec})
    ratios = {}
    for size, s in steps.items():
        lion = s.get("lion_ms")
        if lion:
            ratios[size] = {k: round(s[f"{k}_ms"] / lion, 3)
                            for k in ("vote-1bit", "vote-1bit-checked", "vote-1bit-overlapped", "l1-pbit",
                                      "l1-pbit-checked", "l1-pbit-overlapped")
                            if s.get(f"{k}_ms")}
            if s.get("lion_pytorch_ms"):
                ratios[size]["lion-pytorch / lion"] = round(s["lion_pytorch_ms"] / lion, 3)
            if s.get("twin_lion_ms"):
                ratios[size]["twin lion / lion"] = round(s["twin_lion_ms"] / lion, 3)
    out["step_ratios"] = ratios
    return out


def step_bench(ctx: Ctx) -> None:
    r = ctx.result
    r["runs"] = {}
    budget = ctx.left() - 2
    for i, spec in enumerate(ctx.cfg["bench"]):
        last = i == len(ctx.cfg["bench"]) - 1  # the last run gets whatever time the others left
        cmd = [sys.executable, "-c", LIONCUB_CLI, "bench", "kernels", "--device", ctx.device, "--json",
               "--sizes", spec["sizes"], "--dtype", spec["dtype"]]
        if spec.get("repeat"):
            cmd += ["--repeat", str(spec["repeat"])]
        run = run_cmd(cmd, ctx.left() - 2 if last else min(ctx.left() - 2, budget * spec["share"]), env=ctx.env(),
                      log=ctx.out / "04-bench.log")
        res = None
        try:
            res = _parse_json(run["out"]) if run["rc"] == 0 else None
        except json.JSONDecodeError:
            pass
        name = spec["dtype"]
        entry = dict(command=" ".join(cmd), rc=run["rc"], timed_out=run["timed_out"], seconds=run["seconds"])
        if res is None:
            entry["error"] = tail(run["out"], 2000)
        else:
            (ctx.out / f"04-bench-{name}.json").write_text(json.dumps(res, indent=2))
            big = 64 * 2**20 if ctx.cuda else 0
            entry.update(_bench_summary(res, big))
            entry["bench_targets"] = res.get("targets", {})
        r["runs"][name] = entry
        ctx.check(f"bench {name} ran", res is not None)
        ctx.save()
    mins = [e.get("min_codec_of_copy") for e in r["runs"].values()]
    if ctx.cuda:
        ctx.target("quantize-and-pack, unpack-and-apply >= 85% of copy (>= 64M, fp32 and bf16)",
                   all(m is not None and m >= 0.85 for m in mins) if len(mins) == 2 else None)
    fp32 = r["runs"].get("float32", {})
    ratios = fp32.get("step_ratios", {})
    if ratios:
        size = max(ratios, key=int)
        r["largest"] = dict(size=int(size), **ratios[size])
        if ctx.cuda:
            ctx.target("vote-1bit codec <= 1.3x fused Lion (largest bucket)",
                       ratios[size].get("vote-1bit", 9) <= 1.3)
    parts = []
    for name, e in r["runs"].items():
        if e.get("copy_gbps") is not None:
            m = e.get("min_codec_of_copy")
            parts.append(f"{name}: copy {e['copy_gbps']:.0f} GB/s, codec kernels >= "
                         f"{'-' if m is None else f'{100 * m:.0f}%'} of copy")
        else:
            parts.append(f"{name}: FAILED (rc {e['rc']}{', timeout' if e['timed_out'] else ''})")
    if "largest" in r:
        parts.append(f"vote-1bit step {r['largest'].get('vote-1bit', float('nan')):.2f}x fused Lion at "
                     f"{r['largest']['size']} elements")
    r["summary"] = "; ".join(parts)


# --- 5 optimizer -----------------------------------------------------------------------------------------


def gpt2_shapes(n_layer: int, d: int, vocab: int, ctx: int) -> list[tuple]:
    """Parameter shapes of GPT-2 (124M with n_layer=12, d=768, vocab=50257, ctx=1024: 124,439,808)."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def _timer(torch, device):
    def measure(fn, steps):
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(steps):
                fn()
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1) / steps
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        return 1e3 * (time.perf_counter() - t) / steps
    return measure


def step_optimizer(ctx: Ctx) -> None:
    """1. the contenders on the same GPT-2-shaped parameters and gradients; 2. three steps of each from the same
    start, compared; 3. their step times, interleaved; 4. the compressed codec against the fused Lion step,
    from step 4's bench; 5. the summary."""
    import torch

    device = torch.device(ctx.device)
    contenders, base, n = _contenders(ctx, torch, device)
    _first_steps(ctx, torch, device, contenders, base)
    if ctx.cuda:
        _skips_on_the_device(ctx, torch, device)
    ctx.save()
    ms = _step_times(ctx, torch, device, contenders, n)
    del contenders
    _check_in_backward(ctx, torch, device, n)
    _codec_of_bench(ctx, n)
    ctx.result["summary"] = _optimizer_summary(ctx.result, ms, n)


def _skips_on_the_device(ctx: Ctx, torch, device) -> None:
    """LionCub alone on the GPU: step() makes no host sync (the finite check stays on the device: a read-back
    would drain the queue), and a NaN gradient leaves parameters and momenta as they were, counted once its
    flag is back."""
    from lioncub import LionCub

    ps = [torch.nn.Parameter(torch.randn(4096 + k, device=device)) for k in range(3)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = LionCub(ps, lr=1e-3, weight_decay=0.1)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
        synced = None
    except RuntimeError as exc:
        synced = str(exc)[:400]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ctx.result["step_sync_error"] = synced
    ctx.check("LionCub world size 1: step() without a host sync", synced is None)
    before = [t.detach().clone() for p in ps for t in (p, opt.state[p]["exp_avg"])]
    ps[1].grad[7] = float("nan")
    opt.step()
    torch.cuda.synchronize()
    kept = all(torch.equal(a, b) for a, b in zip(before, [t for p in ps for t in (p, opt.state[p]["exp_avg"])]))
    ctx.check("LionCub world size 1: a NaN gradient skipped on the device, counted once back",
              kept and opt.stats.skipped_steps == 1)


def _contenders(ctx: Ctx, torch, device) -> tuple[dict, list, int]:
    """({name: (parameters, optimizer)}, the initial parameters, the parameter count): LionCub with and
    without its finite check, lion-pytorch's Lion and torch's fused AdamW, each on its own copy."""
    import math

    from lioncub import LionCub, kernels
    r = ctx.result
    shapes = gpt2_shapes(**ctx.cfg["gpt2"])
    n = sum(math.prod(s) for s in shapes)
    r.update(shapes=len(shapes), params=n, dtype="float32", kernels=os.environ.get("LIONCUB_KERNELS", "auto"))
    gen = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(s, generator=gen, device=device).mul_(0.02) for s in shapes]
    grads = [torch.randn(s, generator=gen, device=device) for s in shapes]

    def fresh():
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        return ps

    hp = dict(lr=1e-4, weight_decay=0.1)
    contenders = {}
    ps = fresh()
    contenders["lioncub"] = (ps, LionCub(ps, **hp))
    r["backend"] = kernels.implementation(ps[0].detach()).__name__
    ps = fresh()
    contenders["lioncub, no finite check"] = (ps, LionCub(ps, skip_nonfinite=False, **hp))
    try:
        from lion_pytorch import Lion
        ps = fresh()
        # its Triton kernel needs CUDA tensors; on CPU its torch update
        contenders["lion-pytorch" + (" (triton)" if ctx.cuda else " (torch)")] = (
            ps, Lion(ps, use_triton=ctx.cuda, **hp))
    except ImportError as exc:
        r["lion_pytorch_error"] = str(exc)
    ps = fresh()
    contenders["torch AdamW(fused=True)"] = (ps, torch.optim.AdamW(ps, fused=True, **hp))
    ctx.check("lion-pytorch available", "lion_pytorch_error" not in r)
    return contenders, base, n


def _first_steps(ctx: Ctx, torch, device, contenders: dict, base: list) -> None:
    """The same three steps from the same start: LionCub against lion-pytorch (its Triton kernel computes
    (m - g)*b1 + g and decays with an fp32 1 - lr*wd, so rounding-level differences are expected there)."""
    r = ctx.result
    for _, opt in contenders.values():
        for _ in range(3):  # also the warm-up: Triton compiles, lion-pytorch autotunes
            opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    lc = contenders["lioncub"][0]
    ctx.check("LionCub parameters finite and moved", all(bool(torch.isfinite(p).all()) for p in lc) and
              not all(torch.equal(p.detach(), b) for p, b in zip(lc, base)))
    lp = next((v[0] for k, v in contenders.items() if k.startswith("lion-pytorch")), None)
    if lp is not None:
        diff = sum(int((a.detach() != b.detach()).sum()) for a, b in zip(lc, lp))
        r["lioncub_vs_lion_pytorch_mismatches"] = diff
        r["lioncub_vs_lion_pytorch_note"] = "after 3 steps from the same parameters and gradients"


def _step_times(ctx: Ctx, torch, device, contenders: dict, n: int) -> dict:
    """Median ms per step of each contender over interleaved rounds (the contenders see the same machine
    state), LionCub's bandwidth against the copy's, and the speed targets."""
    import statistics

    r = ctx.result
    measure = _timer(torch, device)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(ctx.cfg["opt_rounds"]):
        for name, (_, opt) in contenders.items():
            times[name].append(measure(opt.step, ctx.cfg["opt_steps"]))
        if ctx.left() < 5:
            break
    ms = {k: statistics.median(v) for k, v in times.items()}
    r["step_ms"] = {k: round(v, 4) for k, v in ms.items()}
    copy = _read_step(ctx.out, "env").get("copy", {}).get("gbps")
    r["copy_gbps"] = copy
    if copy:  # by design: Lion 20 bytes per fp32 parameter (p, g, m read; p, m written), + 4 for the check
        r["lioncub_gbps"] = round(24 * n / (ms["lioncub"] / 1e3) / 1e9, 1)
        r["lioncub_of_copy"] = round(r["lioncub_gbps"] / copy, 3)
    lion = ms["lioncub"]
    r["speedup"] = {k: round(v / lion, 3) for k, v in ms.items() if k != "lioncub"}
    lp_name = next((k for k in ms if k.startswith("lion-pytorch")), None)
    if ctx.cuda:
        ctx.target("LionCub world size 1 >= 1.0x lion-pytorch's Triton Lion",
                   None if lp_name is None else ms[lp_name] >= lion)
        ctx.target("LionCub world size 1 faster than torch fused AdamW", ms["torch AdamW(fused=True)"] > lion)
    return ms


def _check_in_backward(ctx: Ctx, torch, device, n: int) -> None:
    """LionCub's step() after a backward that took the finite check (lioncub.optim.finite), against LionCub
    without any check, each step() timed alone, and backward's time beside it. Two backwards: the gradients'
    accumulation alone (torch.autograd.backward on the parameters: memory-bound, as the check is), and one that
    computes before each gradient lands (a matmul per parameter tensor, as a layer's backward would), where
    the check's side stream can run beside it: there the whole iteration is compared."""
    from lioncub import LionCub
    r = ctx.result
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = gpt2_shapes(**ctx.cfg["gpt2"])
    grads = [torch.randn(s, generator=gen, device=device) for s in shapes]
    runs = {}
    for name, skip in (("check in backward", True), ("no check", False)):
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device).mul_(0.02)) for s in shapes]
        runs[name] = (ps, LionCub(ps, lr=1e-4, weight_decay=0.1, skip_nonfinite=skip))
    plain, used = _iterations(ctx, torch, device, runs, lambda ps: torch.autograd.backward(ps, grads))
    busy, used_busy = _iterations(ctx, torch, device, runs, _busy_backward(torch, device, grads, ctx.cfg["busy_dim"]))
    copy = _read_step(ctx.out, "env").get("copy", {}).get("gbps")
    bound = 20 * n / copy / 1e6 if copy else None  # ms: p, g, m read, p, m written, fp32
    step = plain["check in backward"]["step"]
    r["check_in_backward"] = dict(
        ms=plain, flags_used=used and used_busy, bound_20_bytes_ms=bound and round(bound, 4),
        step_x_bound=bound and round(step / bound, 3),
        check_cost_in_backward_ms=round(plain["check in backward"]["backward"] - plain["no check"]["backward"], 4),
        compute_bound_backward=dict(ms=busy, busy_dim=ctx.cfg["busy_dim"], check_cost_in_iteration_ms=round(
            busy["check in backward"]["iteration"] - busy["no check"]["iteration"], 4)),
        note="medians; backward: zero_grad() and the backward; step(): alone; iteration: both")
    ctx.check("the finite check taken in backward was used by every step", used and used_busy)
    if ctx.cuda:
        ctx.target("LionCub world size 1, check taken in backward: step <= 1.10x 20 bytes/parameter at copy bandwidth",
                   None if bound is None else step <= 1.10 * bound)


def _iterations(ctx: Ctx, torch, device, runs: dict, backward) -> tuple[dict, bool]:
    """({run: median ms of backward, step, iteration}, whether every checked step had its flags), over
    interleaved iterations after 3 warm-up ones."""
    import statistics

    times = {k: dict(backward=[], step=[], iteration=[]) for k in runs}
    used = []
    for i in range(ctx.cfg["opt_rounds"] * ctx.cfg["opt_steps"] + 3):
        for name, (ps, opt) in runs.items():
            t_back = _timed_once(torch, device, lambda o=opt, q=ps: (o.zero_grad(), backward(q)))
            if opt.engine.backward_check is not None:
                used.append(all(f is not None for f in opt.engine.backward_check.flags(opt.engine.buckets)))
            t_step = _timed_once(torch, device, opt.step)
            if i >= 3:
                for part, t in (("backward", t_back), ("step", t_step), ("iteration", t_back + t_step)):
                    times[name][part].append(t)
        if i >= 3 and ctx.left() < 5:  # (at least one timed iteration: a median needs one)
            break
    return {k: {part: round(statistics.median(v), 4) for part, v in t.items()} for k, t in times.items()}, all(used)


def _busy_backward(torch, device, grads: list, dim: int):
    """backward(params): each parameter's gradient (grads') lands after a (dim x dim) matmul, as after a layer's
    backward compute."""
    w = torch.randn(dim, dim, device=device)

    class Land(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p, g):
            ctx.g = g
            return p.view_as(p)

        @staticmethod
        def backward(ctx, _):
            torch.mm(w, w)
            return ctx.g, None

    def backward(params):
        torch.autograd.backward([Land.apply(p, g).sum() for p, g in zip(params, grads)])
    return backward


def _timed_once(torch, device, fn) -> float:
    """ms of fn alone (CUDA: between events around it, the queue drained first)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1)
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def _codec_of_bench(ctx: Ctx, n: int) -> None:
    """The compressed codec on a bucket of the same size, from step 4 (lioncub bench kernels, N = 8)."""
    r = ctx.result
    bench = ctx.out / "04-bench-float32.json"
    if bench.exists():
        res = json.loads(bench.read_text())
        row = next((s for s in res.get("steps", []) if s["size"] == n), None)
        if row is not None:
            checked, overlapped = row.get("vote-1bit-checked_ms"), row.get("vote-1bit-overlapped_ms")
            l1_checked = row.get("l1-pbit-checked_ms")
            r["codec"] = dict(size=n, world_size=res.get("world_size"), lion_ms=row["lion_ms"],
                              vote_1bit_ms=row["vote-1bit_ms"], l1_pbit_ms=row["l1-pbit_ms"],
                              vote_1bit_checked_ms=checked,
                              vote_1bit_x_lion=round(row["vote-1bit_ms"] / row["lion_ms"], 3),
                              vote_1bit_checked_x_lion=checked and round(checked / row["lion_ms"], 3),
                              vote_1bit_overlapped_step_x_lion=overlapped and round(overlapped / row["lion_ms"], 3),
                              l1_pbit_overlapped_step_x_lion=row.get("l1-pbit-overlapped_ms") and round(
                                  row["l1-pbit-overlapped_ms"] / row["lion_ms"], 3),
                              l1_pbit_x_lion=round(row["l1-pbit_ms"] / row["lion_ms"], 3),
                              l1_pbit_checked_x_lion=l1_checked and round(l1_checked / row["lion_ms"], 3),
                              source="04-bench-float32.json: prepass + quantize_pack + vote (N rows) + unpack_apply; "
                                     "checked: without the prepass (backward took the finite check, and l1-pbit's "
                                     "L1 scales); overlapped step: "
                                     "unpack_apply with the deferred momentum update alone (the rest ran in backward)")
            if ctx.cuda:  # issue 30's targets
                ctx.target("vote-1bit codec, check taken in backward, <= 1.15x fused Lion (GPT-2 124M elements)",
                           None if checked is None else r["codec"]["vote_1bit_checked_x_lion"] <= 1.15)
                ctx.target("l1-pbit codec <= 1.5x fused Lion (GPT-2 124M elements), pre-pass in step()",
                           r["codec"]["l1_pbit_x_lion"] <= 1.5)
                ctx.target("l1-pbit codec, pre-pass taken in backward, <= 1.5x fused Lion (GPT-2 124M elements)",
                           None if l1_checked is None else r["codec"]["l1_pbit_checked_x_lion"] <= 1.5)
    if "codec" not in r:
        r["codec"] = "not measured (step 4 has no bucket of this size)"


def _optimizer_summary(r: dict, ms: dict, n: int) -> str:
    lion = ms["lioncub"]
    parts = [f"{n / 1e6:.2f}M params: LionCub {lion:.3f} ms/step"]
    parts += [f"{k} {ms[k]:.3f} ms (= {ms[k] / lion:.2f}x LionCub's)" for k in ms if k != "lioncub"]
    cb = r.get("check_in_backward")
    if cb:
        parts.append(f"check in backward: step {cb['ms']['check in backward']['step']:.3f} ms"
                     + (f" = {cb['step_x_bound']:.2f}x 20 B/param at copy" if cb.get("step_x_bound") else "")
                     + f", {cb['compute_bound_backward']['check_cost_in_iteration_ms']:+.3f} ms per iteration "
                       "beside a computing backward")
    if isinstance(r["codec"], dict):
        c = r["codec"]
        checked, l1_checked = c.get("vote_1bit_checked_x_lion"), c.get("l1_pbit_checked_x_lion")
        parts.append(f"codec vote-1bit {c['vote_1bit_x_lion']:.2f}x"
                     + (f" ({checked:.2f}x with the check in backward)" if checked else "")
                     + f", l1-pbit {c['l1_pbit_x_lion']:.2f}x"
                     + (f" ({l1_checked:.2f}x with the pre-pass in backward)" if l1_checked else "") + " fused Lion")
    return "; ".join(parts)


# --- 6 ranks ---------------------------------------------------------------------------------------------


def ranks_body(rank, world_size, cfg):
    """One rank: every method on both kernel backends, `steps` steps, then all replicas compared (on the
    host, so the comparison itself does not depend on the backend's CUDA support)."""
    import hashlib

    import torch
    import torch.distributed as dist

    from lioncub import LionCub, kernels, methods
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU (NCCL would need one GPU per rank: Gloo here)
    out = {}
    for backend in cfg["backends"]:
        os.environ["LIONCUB_KERNELS"] = backend
        for method in cfg["methods"]:
            gen = torch.Generator().manual_seed(0)
            kinds = [(cfg["shapes"], torch.float32), (cfg["bf16"], torch.bfloat16), (cfg["fp16"], torch.float16)]
            groups = [[torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype).to(device)) for s in shapes]
                      for shapes, dtype in kinds]
            params = [p for g in groups for p in g]
            opt = LionCub([dict(params=groups[0]), dict(params=groups[1], lr=0.02, weight_decay=0.0),
                           dict(params=groups[2], lr=0.005, betas=(0.8, 0.95))], lr=0.01, weight_decay=0.1,
                          method=method, bucket_mb=cfg["bucket_mb"],
                          momentum_sync=None if methods.get(method).dense else cfg["sync_every"])
            start = torch.cat([p.detach().double().cpu().reshape(-1) for p in params])
            t0 = time.perf_counter()
            for step in range(1, cfg["steps"] + 1):
                g = torch.Generator().manual_seed(1000 * step + rank)
                for p in params:
                    grad = torch.randn(p.shape, generator=g)
                    grad.view(-1)[::5] = 0
                    p.grad.copy_(grad.to(p.dtype))
                opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if rank == 0:  # progress in the step's log: a run cut short shows where its time went
                print(f"ranks: world size {world_size}, {backend} {method}: {cfg['steps']} steps in {seconds:.2f} s",
                      file=sys.stderr, flush=True)
            flat = torch.cat([p.detach().double().cpu().reshape(-1) for p in params])
            moms = torch.cat([opt.state[p]["exp_avg"].detach().double().cpu().reshape(-1) for p in params])
            gathered = [torch.empty_like(flat) for _ in range(world_size)]
            dist.all_gather(gathered, flat)
            out[f"{backend} {method}"] = dict(
                replicas_equal=all(torch.equal(gathered[0], x) for x in gathered),
                moved=int((flat != start).sum()), elements=flat.numel(), finite=bool(torch.isfinite(flat).all()),
                skipped=opt.stats.skipped_steps, step_ms=1e3 * seconds / cfg["steps"],
                digest=hashlib.sha256(flat.numpy().tobytes() + moms.numpy().tobytes()).hexdigest()[:16],
                ran=kernels.implementation(params[0].detach()).__name__, buckets=len(getattr(opt, "_buckets", ())))
    return out


def step_ranks(ctx: Ctx) -> None:
    from gpu_check import ranks_body  # by its module name, not __main__'s, for the spawned ranks

    from lioncub import methods
    from lioncub.comm.spawn import spawn
    names = list(methods.NAMES)
    r, rc = ctx.result, ctx.cfg["ranks"]
    cfg = dict(device=ctx.device, backends=["triton", "torch"], methods=names, steps=rc["steps"],
               shapes=rc["shapes"], bf16=rc["bf16"], fp16=rc["fp16"], bucket_mb=rc["bucket_mb"],
               sync_every=rc["sync_every"])
    r.update(steps=rc["steps"], methods=names, backends=cfg["backends"], runs={})
    env = {k: v for k, v in ctx.env().items() if k.startswith(("LIONCUB_", "TRITON_"))}
    for i, world in enumerate(rc["world_sizes"]):
        left = ctx.left() - 2
        timeout = left / (len(rc["world_sizes"]) - i)
        try:
            reports = spawn(ranks_body, world, cfg, timeout=timeout, pg_timeout=max(30.0, timeout), env=env)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next world size
            r["runs"][str(world)] = dict(error=tail(str(exc), 3000))
            ctx.check(f"{world} ranks ran", False)
            ctx.save()
            continue
        ctx.check(f"{world} ranks ran", True)
        rows = {}
        for key in reports[0]:
            per = [rep[key] for rep in reports]
            backend, method = key.split(" ")
            rows[key] = dict(replicas_equal=all(p["replicas_equal"] for p in per),
                             moved=per[0]["moved"], elements=per[0]["elements"],
                             finite=all(p["finite"] for p in per), skipped=max(p["skipped"] for p in per),
                             step_ms=round(max(p["step_ms"] for p in per), 3), digest=per[0]["digest"],
                             ran=per[0]["ran"], buckets=per[0]["buckets"])
            ctx.check(f"{world} ranks, {key}: replicas identical", rows[key]["replicas_equal"])
            row = rows[key]
            ctx.check(f"{world} ranks, {key}: finite, moved, no skipped step",
                      row["finite"] and row["moved"] > row["elements"] // 2 and not row["skipped"])
        want = "lioncub.kernels.triton_ops"
        ctx.check(f"{world} ranks: the triton backend ran the Triton kernels",
                  all(v["ran"] == want for k, v in rows.items() if k.startswith("triton ")))
        same = {m: rows[f"triton {m}"]["digest"] == rows[f"torch {m}"]["digest"] for m in names}
        r["runs"][str(world)] = dict(methods=rows, triton_equals_torch=same)
        ctx.target(f"{world} ranks: Triton and torch twins give the same parameters after {rc['steps']} steps",
                   all(same.values()))
        ctx.save()
    equal = sum(v for run in r["runs"].values() for v in run.get("triton_equals_torch", {}).values())
    total = sum(len(run.get("triton_equals_torch", {})) for run in r["runs"].values())
    ok = [c for c in r["checks"] if "replicas identical" in c]
    r["summary"] = (f"world sizes {rc['world_sizes']} on {ctx.device} over Gloo, {len(names)} methods x 2 backends, "
                    f"{rc['steps']} steps: replicas identical in {sum(r['checks'][c] for c in ok)}/{len(ok)} runs; "
                    f"Triton == torch twins in {equal}/{total}")


# --- 7 train ---------------------------------------------------------------------------------------------


def train_run(out_path: str, device: str, cfg: dict) -> None:
    """One training run in this process (LIONCUB_KERNELS from the environment), deterministic algorithms."""
    import torch

    from lioncub import kernels
    from lioncub.apps.train.loop import TrainConfig, train
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # the math attention: flash / memory-efficient backward kernels accumulate with atomics
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
    tc = TrainConfig(model=cfg["model"], method="l1-pbit", steps=cfg["steps"], batch_size=cfg["batch_size"],
                     block_size=cfg["block_size"], eval_batches=cfg["eval_batches"], device=device, seed=0,
                     threads=0 if device == "cuda" else 1)
    t0 = time.perf_counter()
    s = train(tc, progress=False)
    seconds = time.perf_counter() - t0
    probe = torch.zeros(1, device=device)
    res = dict(kernels_env=os.environ.get("LIONCUB_KERNELS", "auto"), ran=kernels.implementation(probe).__name__,
               params=s["params"], final_loss=s["final_loss"], losses=[x["loss"] for x in s["records"]],
               step_ms=1e3 * s["step_seconds"], seconds=seconds)
    Path(out_path).write_text(json.dumps(res))


def _curve_diff(a: list[float], b: list[float]) -> dict:
    first = next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    tail_n = max(1, min(20, len(a) // 5))
    ta, tb = sum(a[-tail_n:]) / tail_n, sum(b[-tail_n:]) / tail_n
    return dict(identical=a == b, first_different_step=first,
                max_abs_diff=max((abs(x - y) for x, y in zip(a, b)), default=0.0),
                tail_mean_rel_diff=abs(ta - tb) / max(abs(ta), 1e-12), tail_steps=tail_n)


TRAIN_TOLERANCE = 0.02  # relative, on the mean loss of the last steps and on the eval loss


def step_train(ctx: Ctx) -> None:
    """1. the three runs, concurrently (only the loss values are compared, not the times); 2. their results;
    3. each run's own checks; 4. the triton run's loss curve against the torch run's."""
    r, cfg = ctx.result, ctx.cfg["train"]
    r.update(config=cfg, tolerance=TRAIN_TOLERANCE)
    procs = _start_train_runs(ctx, cfg)
    res = _train_results(ctx, procs)
    r["runs"] = {k: {kk: vv for kk, vv in v.items() if kk != "losses"} | dict(first_losses=v["losses"][:3],
                                                                              last_loss=v["losses"][-1])
                 for k, v in res.items()}
    _check_train_runs(ctx, res)
    if "triton" in res and "torch" in res:
        _compare_train_runs(ctx, cfg, res)
    else:
        r["summary"] = "a run failed: see 07-train.log"


def _start_train_runs(ctx: Ctx, cfg: dict) -> dict:
    """label -> (its result file, its process): the Triton kernels, the torch twins, Triton again (control)."""
    runs = {"triton": "triton", "torch": "torch", "triton (control)": "triton"}
    procs = {}
    for label, backend in runs.items():
        path = ctx.out / f"07-train-{label.split()[0]}{'-control' if 'control' in label else ''}.json"
        path.unlink(missing_ok=True)
        code = (f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); from gpu_check import train_run; "
                f"train_run({str(path)!r}, {ctx.device!r}, {cfg!r})")
        env = ctx.env(LIONCUB_KERNELS=backend, CUBLAS_WORKSPACE_CONFIG=":4096:8")  # deterministic cuBLAS
        procs[label] = (path, subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env,
                                               stdout=open(ctx.out / "07-train.log", "a"), stderr=subprocess.STDOUT,
                                               preexec_fn=os.setpgrp))
    return procs


def _train_results(ctx: Ctx, procs: dict) -> dict:
    """label -> the result of each run that finished within the step's time (the others are killed)."""
    deadline = time.monotonic() + ctx.left() - 2
    res = {}
    for label, (path, proc) in procs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
        ok = proc.returncode == 0 and path.exists()
        ctx.check(f"run {label} finished", ok)
        if ok:
            res[label] = json.loads(path.read_text())
    return res


def _check_train_runs(ctx: Ctx, res: dict) -> None:
    if "triton" in res:
        ctx.check("the triton run ran the Triton kernels", res["triton"]["ran"] == "lioncub.kernels.triton_ops")
        losses = res["triton"]["losses"]
        if ctx.size == "full":
            k = max(1, len(losses) // 10)
            ctx.check("the triton run's loss went down", sum(losses[-k:]) < sum(losses[:k]))
        else:
            ctx.check("the triton run's losses are finite", all(x == x and abs(x) < float("inf") for x in losses))
    if "torch" in res:
        ctx.check("the torch run ran the torch twins", res["torch"]["ran"] == "lioncub.kernels.reference")


def _compare_train_runs(ctx: Ctx, cfg: dict, res: dict) -> None:
    r = ctx.result
    a, b = res["triton"], res["torch"]
    d = _curve_diff(a["losses"], b["losses"])
    d["eval_rel_diff"] = abs(a["final_loss"] - b["final_loss"]) / max(abs(b["final_loss"]), 1e-12)
    r["triton_vs_torch"] = d
    control = res.get("triton (control)")
    r["control_identical"] = None if control is None else control["losses"] == a["losses"]
    if d["identical"] and a["final_loss"] == b["final_loss"]:
        verdict, ok = "bit-identical loss curves", True
    else:
        ok = d["tail_mean_rel_diff"] <= TRAIN_TOLERANCE and d["eval_rel_diff"] <= TRAIN_TOLERANCE
        why = ("the model's forward/backward is itself not deterministic here (the control run differs)"
               if r["control_identical"] is False else
               "the kernels differ from the twins at rounding level (a sign flip where |c| is at rounding "
               "level); from the first such step the two runs follow different but equally good trajectories")
        verdict = (f"not bit-identical from step {d['first_different_step']}: {why}; last-{d['tail_steps']}-step "
                   f"mean loss {100 * d['tail_mean_rel_diff']:.2f}% and eval loss {100 * d['eval_rel_diff']:.2f}% "
                   f"apart (tolerance {100 * TRAIN_TOLERANCE:.0f}%)")
    r["verdict"] = verdict
    ctx.check("same loss curve (bit-identical, or within the tolerance)", ok)
    ctx.target("Triton vs torch twins bit-identical (200-step training)" if ctx.size == "full"
               else "Triton vs torch twins bit-identical (training)", d["identical"])
    r["summary"] = (f"{cfg['model']} ({a['params'] / 1e6:.1f}M), {cfg['steps']} steps on {ctx.device}: "
                    f"{verdict}; eval loss {a['final_loss']:.4f} (triton) / {b['final_loss']:.4f} (torch); "
                    f"step {a['step_ms']:.1f} / {b['step_ms']:.1f} ms")


# --- 8 nccl ----------------------------------------------------------------------------------------------

NCCL_LR, NCCL_WD = 1e-3, 0.1


def step_nccl(ctx: Ctx) -> None:
    """The user's path on one process at world size 1: `lioncub.init_distributed()` under torchrun's variables,
    so NCCL on the GPU (Gloo on CPU, the rehearsal). 1. every method's exchange of one bucket through its
    collectives on the default group and on a subgroup, against the same exchange with the CPU twins on a Gloo
    group; 2. LionCub with every method, flat and hierarchical, overlap on and off; 3. `lioncub.attach_ddp` on a
    torch DDP model; 4. `lioncub.GradScaler` with fp16 autocast, an overflow included; 5. `lioncub.checkpoint`
    save and load: the resumed run equals the uninterrupted one. NCCL-specific misuse (a dtype or device NCCL
    refuses, a subgroup, a stream) raises in 1-5."""
    import torch
    import torch.distributed as dist

    import lioncub
    from lioncub.comm.distributed import free_port
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.use_deterministic_algorithms(True, warn_only=True)
    rank, world = lioncub.init_distributed(timeout=60)
    r = ctx.result
    r["backend"] = dist.get_backend()
    ctx.check("init_distributed chose NCCL on the GPU (Gloo without one), world size 1",
              (r["backend"], world) == ("nccl" if ctx.cuda else "gloo", 1))
    device = torch.device("cuda" if ctx.cuda else "cpu")
    try:
        _nccl_exchanges(ctx, torch, dist, device)
        ctx.save()
        finals = _nccl_optimizers(ctx, torch, device)
        _nccl_ddp(ctx, torch, device, finals)
        _nccl_scaler(ctx, torch, device)
        _nccl_checkpoint(ctx, torch, device)
    finally:
        lioncub.finish()
    failed = [k for k, v in r["checks"].items() if not v]
    r["summary"] = (f"{r['backend']} at world size 1 on {device.type}: {len(r['checks']) - len(failed)} of "
                    f"{len(r['checks'])} checks" + (f"; failed: {', '.join(failed)}" if failed else ""))


def _nccl_exchanges(ctx: Ctx, torch, dist, device) -> None:
    """Each method's exchange (encode, collectives, apply) on the default group and on a subgroup, against the
    same exchange with the torch twins on CPU tensors and a Gloo group: the parameters and momenta after it."""
    from lioncub import methods
    n = 4099 if ctx.size == "tiny" else 1 << 20
    gloo, sub = dist.new_group([0], backend="gloo"), dist.new_group([0])
    res = {}
    for name in methods.NAMES:
        spec = methods.get(name)
        ref = _one_exchange(torch, spec, n, torch.device("cpu"), gloo)
        for where, group in (("default group", None), ("subgroup", sub)):
            got = _one_exchange(torch, spec, n, device, group)
            diff = sum(int((a != b).sum()) for a, b in zip(got, ref))
            res[f"{name} ({where})"] = diff
    ctx.result["exchange_mismatches"] = res
    ctx.result["exchange_elements"] = n
    # the twins and the kernels agree bit for bit (step 3); a flip where |c| is at rounding level is allowed
    ctx.check("every method's exchange ran on the default group and a subgroup, as the CPU twins on Gloo give",
              all(v <= max(2, n // 100_000) for v in res.values()))


def _one_exchange(torch, spec, n: int, device, group) -> list:
    """(parameters, momenta) after one exchange of a bucket of n elements (fixed values) on `group`, on the CPU."""
    gen = torch.Generator().manual_seed(7)
    g, m, p = (torch.randn(n, generator=gen).to(device) for _ in range(3))
    offsets = [0, n // 3, n]
    if spec.dense:
        ex = spec.exchange(n, device, group, grads=g)
        ex()
        return [g.cpu()]
    ex = spec.exchange(n, device, group, levels=spec.resolve_levels(1))
    ex.encode(g, m, beta1=0.9, beta2=0.99, offsets=offsets)
    ex.apply(p, ex(), lr=NCCL_LR, wd=NCCL_WD)
    return [p.cpu(), m.cpu()]


def _nccl_model(torch, device, seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to(device)


def _nccl_batches(torch, device, steps: int):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 32, generator=gen).to(device), torch.randint(10, (16,), generator=gen).to(device))
            for _ in range(steps)]


def _train_steps(torch, net, opt, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def _nccl_optimizers(ctx: Ctx, torch, device) -> dict:
    """LionCub with every method, flat and (compressed methods) hierarchical, overlap on and off: 3 steps of a
    small model each; the parameters are finite, moved, and the same whatever the layout and the overlap."""
    import lioncub
    from lioncub import methods
    batches, finals, ok = _nccl_batches(torch, device, 3), {}, True
    start = [p.detach().clone() for p in _nccl_model(torch, device).parameters()]
    for name in methods.NAMES:
        layouts = [False] if methods.get(name).dense else [False, True]
        for hier in layouts:
            for overlap in (True, False):
                model = _nccl_model(torch, device)
                opt = lioncub.LionCub(model.parameters(), lr=NCCL_LR, weight_decay=NCCL_WD, method=name,
                                      overlap=overlap, hierarchical=hier, node_size=1 if hier else None)
                _train_steps(torch, model, opt, batches)
                finals[(name, hier, overlap)] = [p.detach().clone() for p in model.parameters()]
                ok &= all(bool(torch.isfinite(p).all()) for p in model.parameters())
                ok &= not all(torch.equal(a, b) for a, b in zip(finals[(name, hier, overlap)], start))
    same = all(all(torch.equal(a, b) for a, b in zip(v, finals[(k[0], False, True)])) for k, v in finals.items())
    ctx.result["optimizer_runs"] = len(finals)
    ctx.check("LionCub with every method, flat and hierarchical, overlap on and off: finite, moved", ok)
    ctx.check("the layout and the overlap do not change the parameters", same)
    return finals


def _nccl_ddp(ctx: Ctx, torch, device, finals: dict) -> None:
    """lioncub.attach_ddp on a torch DDP model gives the parameters LionCub gives alone."""
    import lioncub
    model = _nccl_model(torch, device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if device.type == "cuda" else None)
    opt = lioncub.LionCub(model.parameters(), lr=NCCL_LR, weight_decay=NCCL_WD, method="vote-1bit")
    lioncub.attach_ddp(ddp, opt)
    _train_steps(torch, ddp, opt, _nccl_batches(torch, device, 3))
    ctx.check("attach_ddp: a DDP model trains as LionCub alone does",
              all(torch.equal(a, b) for a, b in zip(model.parameters(), finals[("vote-1bit", False, True)])))


def _nccl_scaler(ctx: Ctx, torch, device) -> None:
    """lioncub.GradScaler with fp16 autocast and clipping: 4 steps, an inf gradient in the third; that step is
    skipped (the momenta untouched) and the scale backs off; the others step."""
    import lioncub
    res = {}
    for name in ("allreduce", "vote-1bit"):
        model = _nccl_model(torch, device)
        opt = lioncub.LionCub(model.parameters(), lr=NCCL_LR, weight_decay=NCCL_WD, method=name)
        scaler = lioncub.GradScaler(device.type)
        scales, moved = [], []
        for i, (x, y) in enumerate(_nccl_batches(torch, device, 4)):
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if i == 2:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            scaler.unscale_(opt)
            opt.clip_grad_norm_(1.0)
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
            moved.append(not all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        res[name] = dict(moved=moved, scales=scales,
                         finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    ctx.result["grad_scaler"] = res
    ctx.check("GradScaler + fp16 autocast: the overflowing step skipped, the scale halved, the rest stepped",
              all(v["moved"] == [True, True, False, True] and v["finite"] and v["scales"][2] == v["scales"][1] / 2
                  for v in res.values()))


def _nccl_checkpoint(ctx: Ctx, torch, device) -> None:
    """lioncub.checkpoint: 2 steps, save, 2 steps; a new model and optimizer load the checkpoint and take the
    same 2 steps: the parameters are the uninterrupted run's."""
    import tempfile

    import lioncub
    batches = _nccl_batches(torch, device, 4)
    results = []
    with tempfile.TemporaryDirectory(dir=ctx.out) as tmp:
        path = os.path.join(tmp, "ckpt")
        for resume in (False, True):
            model = _nccl_model(torch, device, seed=1 if resume else 0)  # the resumed run starts elsewhere
            opt = lioncub.LionCub(model.parameters(), lr=NCCL_LR, weight_decay=NCCL_WD, method="vote-1bit")
            if resume:
                info = lioncub.checkpoint.load(path, model, opt)
                ctx.result["checkpoint_load"] = info
            else:
                _train_steps(torch, model, opt, batches[:2])
                lioncub.checkpoint.save(path, model, opt)
            _train_steps(torch, model, opt, batches[2:])
            results.append([p.detach().clone() for p in model.parameters()])
    ctx.check("checkpoint save/load: the resumed run equals the uninterrupted one",
              all(torch.equal(a, b) for a, b in zip(*results)))


# --- the orchestrator ------------------------------------------------------------------------------------

STEP_FUNCS = dict(env=step_env, install=step_install, tests=step_tests, bench=step_bench, optimizer=step_optimizer,
                  ranks=step_ranks, train=step_train, nccl=step_nccl)


def _read_step(out: Path, name: str) -> dict:
    path = out / f"{STEPS.index(name) + 1:02d}-{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def run_step(name: str, out: Path, size: str, device: str, timeout: float) -> int:
    """In the step's own process: run it, record an exception as the step's error, write its JSON."""
    ctx = Ctx(out, size, device, name, timeout)
    try:
        ctx.save()
        inject = dict(x.split(":", 1) for x in os.environ.get("LIONCUB_GPU_CHECK_INJECT", "").split(",") if ":" in x)
        if inject.get(name) == "error":  # rehearsing the failure handling (tests/apps/test_gpu_check.py)
            raise RuntimeError("injected failure (LIONCUB_GPU_CHECK_INJECT)")
        if inject.get(name) == "hang":  # with a child in a process group of its own, as pytest or a bench run
            child = subprocess.Popen(["sleep", str(int(timeout) + 3600)], preexec_fn=os.setpgrp)
            ctx.result["hang_child"] = child.pid
            ctx.save()
            time.sleep(timeout + 3600)
        STEP_FUNCS[name](ctx)
        ctx.result["status"] = "pass" if ctx.result["checks"] and all(ctx.result["checks"].values()) else "fail"
    except BaseException as exc:  # noqa: BLE001 - the orchestrator goes on with the next step
        ctx.result["status"] = "error"
        ctx.result["error"] = tail(traceback.format_exc(), 4000)
        ctx.result["summary"] = ctx.result.get("summary") or f"error: {exc!r}"[:300]
    ctx.save()
    return 0 if ctx.result["status"] == "pass" else 1


def _step_environment(name: str, device: str) -> dict:
    """A step's environment: on CPU the Triton interpreter; the optimizer step on the Triton kernels, never a
    silent fallback to the twins."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cuda":
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    env.pop("LIONCUB_KERNELS", None)
    if name == "optimizer":
        env["LIONCUB_KERNELS"] = "triton"
    if name == "nccl":  # deterministic cuBLAS: the checkpoint's resumed run is compared bit for bit
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
    return env


def _detect_device() -> str:
    r = run_cmd([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], 120)
    return "cuda" if r["rc"] == 0 and r["out"].strip().endswith("True") else "cpu"


def orchestrate(out: Path, size: str | None, only: list[str] | None, device: str | None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    device = device or _detect_device()
    size = size or os.environ.get("LIONCUB_GPU_CHECK_SIZE") or ("full" if device == "cuda" else "tiny")
    cfg = SIZES[size]
    # LIONCUB_GPU_CHECK_TIMEOUTS="tests=150,bench=120": limits that override the size's and the budget's
    overrides = {k.strip(): float(v) for k, v in (item.split("=") for item in
                 filter(None, os.environ.get("LIONCUB_GPU_CHECK_TIMEOUTS", "").split(",")))}
    todo = [s for s in STEPS if not only or s in only]
    print(f"lioncub gpu-check: {device}, size {size}, steps {', '.join(todo)} -> {out}", flush=True)
    results = {}
    for i, name in enumerate(todo):
        left = cfg["budget"] - (time.monotonic() - t_start) - MIN_STEP_S * (len(todo) - i - 1)
        timeout = overrides.get(name) or max(MIN_STEP_S, min(cfg["timeouts"][name], left))
        grace = min(10.0, max(2.0, 0.2 * timeout))
        (out / f"{STEPS.index(name) + 1:02d}-{name}.json").unlink(missing_ok=True)
        cmd = [sys.executable, str(SCRIPTS / "gpu_check.py"), str(out), "--run-step", name, "--size", size,
               "--device", device, "--timeout", str(timeout)]
        log = out / f"{STEPS.index(name) + 1:02d}-{name}.log"
        log.unlink(missing_ok=True)
        print(f"[{STEPS.index(name) + 1}/{len(STEPS)}] {name} (limit {timeout:.0f} s) ...", end=" ", flush=True)
        # the step watches its own time; this limit (a little longer) only catches a step that hangs
        run = run_cmd(cmd, timeout + grace, env=_step_environment(name, device), log=log, session=True)
        res = _read_step(out, name) or dict(step=name, checks={}, targets={})
        if run["timed_out"]:
            res["status"] = "timeout"
            res["summary"] = f"timed out after {timeout + grace:.0f} s; " + res.get("summary", "")
        elif run["rc"] != 0 and res.get("status") in (None, "running", "pass"):
            res["status"] = "error"
            res["error"] = tail(run["out"], 3000)
            res["summary"] = res.get("summary") or f"crashed (rc {run['rc']}): see {log.name}"
        res["wall_seconds"] = run["seconds"]
        res["limit_seconds"] = timeout
        (out / f"{STEPS.index(name) + 1:02d}-{name}.json").write_text(json.dumps(res, indent=2, default=str))
        results[name] = res
        print(f"{res['status']} ({run['seconds']:.0f} s)", flush=True)
        _write_reports(out, results, device, size, time.monotonic() - t_start, todo)  # what we have, so far
    summary = _write_reports(out, results, device, size, time.monotonic() - t_start, todo)
    print(summary, flush=True)
    return 0 if _passed(results) else 1


def _write_reports(out: Path, results: dict, device: str, size: str, seconds: float, todo: list) -> str:
    done = len(results) == len(todo)
    summary = format_summary(results, device, size, seconds)
    if not done:
        summary += f"\n(partial: {len(results)} of {len(todo)} steps so far)\n"
    (out / "summary.txt").write_text(summary)
    (out / "gpu-check.json").write_text(json.dumps(dict(
        device=device, size=size, seconds=round(seconds, 1), date=datetime.date.today().isoformat(),
        status=("pass" if _passed(results) else "fail") if done else "partial", steps=results),
        indent=2, default=str))
    return summary


def _passed(results: dict) -> bool:
    return bool(results) and all(r.get("status") == "pass" for r in results.values())


def format_summary(results: dict, device: str, size: str, seconds: float) -> str:
    env = results.get("env", {})
    head = env.get("summary") if env.get("status") == "pass" else f"device {device}"
    n_ok = sum(r.get("status") == "pass" for r in results.values())
    targets = {k: v for r in results.values() for k, v in r.get("targets", {}).items()}
    met = sum(v is True for v in targets.values())
    lines = [f"lioncub gpu-check {datetime.date.today().isoformat()}: {head}",
             f"size {size}, {seconds:.0f} s: {'PASS' if _passed(results) else 'FAIL'} ({n_ok}/{len(results)} steps "
             f"passed); targets: {met} of {len(targets)} met", ""]
    for name, r in results.items():
        lines.append(f"[{r.get('status', '?'):7s}] {STEPS.index(name) + 1} {name:9s} {r.get('summary', '')}")
        for check, ok in r.get("checks", {}).items():
            if not ok:
                lines.append(f"            failed check: {check}")
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
    ap.add_argument("--size", choices=tuple(SIZES), help="full (default on a GPU) or tiny (default without CUDA; "
                                                        "also LIONCUB_GPU_CHECK_SIZE)")
    ap.add_argument("--only", help=f"comma-separated steps to run, of {','.join(STEPS)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if torch sees a GPU")
    ap.add_argument("--run-step", choices=STEPS, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_step:
        return run_step(args.run_step, args.outdir, args.size or "tiny", args.device or "cpu", args.timeout)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    if only and set(only) - set(STEPS):
        ap.error(f"unknown steps {sorted(set(only) - set(STEPS))}; choose from {', '.join(STEPS)}")
    return orchestrate(args.outdir.resolve(), args.size, only, args.device)


if __name__ == "__main__":
    sys.exit(main())
