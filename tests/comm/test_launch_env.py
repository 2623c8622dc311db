"""init_distributed under SLURM and MPI: the environment parsing (a pure function, no launch) and one real
2-process Gloo job that has only SLURM's variables."""

import multiprocessing as mp
import queue as queue_mod

import pytest
import safe_cases

from lioncub.comm.distributed import free_port
from lioncub.comm.launch import DEFAULT_PORT, LaunchEnv, LaunchError, expand_hostlist, launch_env

SLURM = dict(SLURM_PROCID="3", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_JOB_ID="4242",
             SLURM_JOB_NODELIST="gpu[07-10]", SLURM_STEP_NODELIST="gpu[08-09]", SLURM_STEP_NUM_TASKS="4")


@pytest.mark.parametrize("text,hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("localhost", ["localhost"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("r[1-2]-n[08-09],x", ["r1-n08", "r1-n09", "r2-n08", "r2-n09", "x"]),
    ("gpu[007],cpu[1,3-4].ib", ["gpu007", "cpu1.ib", "cpu3.ib", "cpu4.ib"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-04", "node]1", "node[a-b]", "n[3-1]", "a,,b", "", "n[1-2]]"])
def test_unparsable_hostlist_raises(text):
    with pytest.raises(LaunchError, match="node list"):
        expand_hostlist(text)


def test_torchrun_wins_and_plain_process_is_none():
    assert launch_env({}) is None
    assert launch_env({"PATH": "/bin"}) is None
    env = dict(SLURM, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")  # torchrun started by srun
    assert launch_env(env) == LaunchEnv("torchrun", 1, 2, 1, None, None)


def test_slurm():
    # the step's task count and node list win over the job's; port from the job id
    assert launch_env(SLURM) == LaunchEnv("slurm", 3, 4, 1, "gpu08", DEFAULT_PORT + 242)
    env = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP")}
    assert launch_env(env) == LaunchEnv("slurm", 3, 8, 1, "gpu07", DEFAULT_PORT + 242)
    assert launch_env(dict(env, MASTER_ADDR="10.0.0.1", MASTER_PORT="1234")).master_addr == "10.0.0.1"
    assert launch_env(dict(env, MASTER_PORT="1234")).master_port == 1234
    # one task: a plain single process
    assert launch_env(dict(SLURM_NTASKS="1", SLURM_PROCID="0")).world_size == 1


@pytest.mark.parametrize("change,match", [
    (dict(SLURM_PROCID=None), "no SLURM_PROCID"),
    (dict(SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST=None), "MASTER_ADDR"),
    (dict(SLURM_STEP_NODELIST="gpu[08-"), "node list"),
    (dict(SLURM_PROCID="4"), "not a valid place"),
    (dict(SLURM_PROCID="x"), "not an integer"),
])
def test_slurm_job_that_cannot_be_joined_raises(change, match):
    env = {k: v for k, v in dict(SLURM, **change).items() if v is not None}
    with pytest.raises(LaunchError, match=match):
        launch_env(env)


def test_mpi():
    ompi = dict(OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="2",
                OMPI_COMM_WORLD_LOCAL_SIZE="4")
    assert launch_env(ompi) == LaunchEnv("openmpi", 2, 4, 2, "127.0.0.1", DEFAULT_PORT)
    several_hosts = dict(ompi, OMPI_COMM_WORLD_LOCAL_SIZE="2")
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        launch_env(several_hosts)
    assert launch_env(dict(several_hosts, MASTER_ADDR="h0", MASTER_PORT="999")).master_addr == "h0"
    pmi = dict(PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2")
    assert launch_env(pmi) == LaunchEnv("pmi", 1, 2, 1, "127.0.0.1", DEFAULT_PORT)
    assert launch_env(dict(PMI_SIZE="1", PMI_RANK="0")).world_size == 1
    # SLURM's variables win over MPI's (srun --mpi=pmi2 sets both)
    assert launch_env(dict(SLURM, **pmi)).launcher == "slurm"


def test_two_processes_with_only_slurm_variables_form_one_gloo_group():
    ctx = mp.get_context("forkserver")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=safe_cases.fake_slurm_rank, args=(r, 2, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(q.get(timeout=60) for _ in procs)
    except queue_mod.Empty:
        pytest.fail("the fake srun tasks did not report")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert got == [(0, 0, 2, 3.0, "0"), (1, 1, 2, 3.0, "1")], got  # ranks from SLURM_PROCID; 1 + 2 summed
