"""Local ranks in sessions of their own (lioncub.comm.spawn `sessions`), as torchrun and the lab start them: the
host calibration measures its ranks that way (on kernels that group scheduling by session, a rank's threads then
wait for their own group's turn on the cores)."""

import os

import dist_cases

from lioncub.comm.spawn import spawn


def test_each_rank_leads_a_session_of_its_own_only_when_asked():
    env = {"TEST_PARENT_SID": str(os.getsid(0))}
    own = spawn(dist_cases.session_of, 2, sessions=True, env=env, timeout=120)
    assert all(sid == pid for sid, pid, _ in own)  # each rank leads its session
    assert len({sid for sid, _, _ in own}) == 2 and all(sid != parent for sid, _, parent in own)
    shared = spawn(dist_cases.session_of, 2, env=env, timeout=120)
    assert all(sid == parent != pid for sid, pid, parent in shared)  # the default: the caller's session


def test_a_port_taken_before_the_ranks_bind_it_makes_spawn_start_over(monkeypatch):
    """free_port's port is free when it returns; under a busy test run another process can take it before rank
    0's store binds it. The ranks then cannot join (nothing ran), and spawn starts over on another port."""
    import socket

    from lioncub.comm import spawn as spawn_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], spawn_module.free_port()])
    monkeypatch.setattr(spawn_module, "free_port", lambda: next(ports))
    env = {"TEST_PARENT_SID": str(os.getsid(0))}
    try:
        out = spawn(dist_cases.session_of, 2, env=env, timeout=120, pg_timeout=5)
    finally:
        taken.close()
    assert len(out) == 2 and all(r is not None for r in out)
    assert next(ports, None) is None  # the second port was used
