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
