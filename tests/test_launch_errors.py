"""Mistakes named where they happen: what a LaunchError says when ranks disagree, hang or misuse comm."""
import os
import resource
import signal
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import pplab
from pplab.runtime import callboard, watch
from conftest import descendants

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


class WaitedForTheTimeout(Exception):
    pass


@pytest.fixture
def hang_detector():
    """Fail (instead of hanging) if a launch that should end early waits for its long timeout."""
    def alarm(signum, frame):
        raise WaitedForTheTimeout

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(90)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _mismatched_kinds():
    t = torch.ones(1000)
    if dist.get_rank() == 0:
        pplab.comm.all_reduce(t)
    else:
        pplab.comm.broadcast(t, src=0)


def test_mismatched_collectives_through_comm_are_stopped_early(hang_detector):
    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(_mismatched_kinds, world_size=2, timeout=600)
    msg = str(info.value)
    assert "mismatched collectives: at collective call #0 on the world group" in msg
    assert "rank 0 is in all_reduce(float32[1000], op=sum)" in msg
    assert "rank 1 is in broadcast(float32[1000], src=0)" in msg
    assert info.value.calls[1] == "broadcast(float32[1000], src=0)"
    assert info.value.mismatch and info.value.running == (0, 1)


def test_mismatched_sizes_are_named_with_both_shapes(hang_detector):
    """Same collective, different sizes: the rank that finished its own version is compared too."""
    def f():
        t = torch.ones(3 + dist.get_rank())
        pplab.comm.all_reduce(t)

    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(f, world_size=2, timeout=600)
    msg = str(info.value)
    assert "float32[3]" in msg and "float32[4]" in msg, msg


def test_gloos_own_reason_is_in_the_error(hang_detector):
    def f():
        t = torch.ones(1000 if dist.get_rank() == 0 else 10)
        pplab.comm.all_reduce(t)

    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(f, world_size=4, timeout=600)
    msg = str(info.value)
    # whichever comes first: gloo aborting a rank (its reason quoted), or the call board
    assert ("Received data size doesn't match expected size" in msg
            or ("mismatched collectives" in msg and "float32[1000]" in msg and "float32[10]" in msg)), msg


def test_native_reason_is_taken_from_the_ranks_last_words():
    tail = ["terminate called after throwing an instance of 'gloo::EnforceNotMet'",
            "  what():  [enforce fail at /x/gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. "
            "500 vs 8. Received data size doesn't match expected size."]
    assert watch._native_reason(tail) == ("op.preamble.length <= op.nbytes. 500 vs 8. "
                                          "Received data size doesn't match expected size.")
    assert watch._native_reason(["just output"]) == ""


def test_raw_torch_distributed_mismatch_names_each_ranks_call_at_the_timeout():
    def f():
        t = torch.ones(4)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)

    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(f, world_size=2, timeout=6)       # time to get there on a loaded machine
    err = info.value
    assert err.running == (0, 1)
    assert "rank 0 in torch.distributed.all_reduce called from f" in str(err)
    assert "rank 1 in torch.distributed.broadcast called from f" in str(err)
    assert set(err.stacks) == {0, 1} and "in f" in err.stacks[1]       # every rank's Python stack
    assert "--- Python stack of rank 1" in str(err)


def test_timeout_says_what_each_rank_was_inside():
    def f():
        if dist.get_rank() == 0:
            pplab.comm.recv(torch.zeros(2), src=1)      # rank 1 never sends
        else:
            import time
            time.sleep(300)

    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(f, world_size=2, timeout=6)
    msg = str(info.value)
    assert "rank 0 in recv(float32[2], src=1) since" in msg
    assert "rank 1 running f (" in msg


def test_receives_waiting_on_each_other_are_called_a_deadlock():
    def f():
        peer = (dist.get_rank() + 1) % 3
        if dist.get_rank() == 2:
            pplab.comm.irecv(torch.zeros(1), src=peer).wait()    # async, then waited on: the same
        else:
            pplab.comm.recv(torch.zeros(1), src=peer)

    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(f, world_size=3, timeout=6)
    msg = str(info.value)
    assert "rank 2 in wait for recv(src=0) since" in msg
    assert "Ranks 0 -> 1 -> 2 -> 0 each wait to receive from the next, so none of them ever sends" in msg


def test_returned_rank_while_peer_in_collective_is_a_mismatch(hang_detector):
    def f():
        if dist.get_rank() == 0:
            pplab.comm.all_reduce(torch.ones(2))

    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(f, world_size=2, timeout=600)
    msg = str(info.value)
    assert "rank 0 is in all_reduce(float32[2], op=sum)" in msg
    assert "rank 1 is in the end-of-launch barrier (fn had returned)" in msg


def test_the_same_collective_on_every_rank_is_no_mismatch():
    """Sub-groups count their own calls: the same sequence on two groups is not a mismatch."""
    def f():
        g = dist.new_group([0, 1])
        for _ in range(20):
            pplab.comm.all_reduce(torch.ones(5))
            if dist.get_rank() < 2:
                pplab.comm.broadcast(torch.ones(3), src=1, group=g)
        return True

    assert pplab.launch(f, world_size=3) == [True] * 3


@pytest.mark.parametrize("call, message", [
    (lambda: pplab.comm.broadcast(torch.ones(2), src=5),
     "broadcast: src=5 is not a rank of the group: use one of [0, 1]"),
    (lambda: pplab.comm.reduce_scatter_tensor(torch.zeros(3), torch.ones(4)),
     "reduce_scatter_tensor: output is float32[3]: it must hold input.numel() / 2 ranks = 2 elements"),
    (lambda: pplab.comm.reduce_scatter_tensor(torch.zeros(2), torch.ones(5)),
     "which do not split evenly over the 2 ranks"),
    (lambda: pplab.comm.all_gather_into_tensor(torch.zeros(3), torch.ones(2)),
     "output is float32[3]: it must hold input.numel() * 2 ranks = 4 elements"),
    (lambda: pplab.comm.reduce(torch.ones(2), dst=-1), "reduce: dst=-1 is not a rank"),
])
def test_comm_refuses_bad_shapes_and_roots_on_every_rank(call, message, hang_detector):
    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(call, world_size=2, timeout=600)
    head = str(info.value).split("\n\n")[0]
    assert head.startswith("ranks 0, 1 raised ValueError: ")            # every rank, said once
    assert message in head



def test_no_rank_runs_fn_before_every_rank_has_joined(tmp_path):
    """The start-up rendezvous behind the test above: gloo joins pair by pair, so a rank that ran
    ahead, failed and exited could break a peer still connecting ("lost the connection" where the
    peer would have raised the same error). Here rank 1 arrives late: rank 0 waits for it."""
    import threading
    import time

    from pplab.runtime.rank_main import _everyone_joined
    path, done = str(tmp_path / "store"), {}

    def join(rank):
        _everyone_joined(dist.FileStore(path, 3), 3)
        done[rank] = time.monotonic()

    early = [threading.Thread(target=join, args=(r,), daemon=True) for r in (0, 2)]
    for t in early:
        t.start()
    time.sleep(0.5)
    assert not done, "a rank went on before rank 1 had joined"
    arrived = time.monotonic()
    join(1)
    for t in early:
        t.join(timeout=30)
    assert sorted(done) == [0, 1, 2] and min(done.values()) >= arrived


def test_same_error_on_every_rank_is_said_once():
    def f():                        # no barrier first: the launch runs fn once every rank has joined
        raise ValueError(f"shape {dist.get_world_size()} is wrong")

    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(f, world_size=4)
    head = str(info.value).split("\n\n")[0]
    assert head == "ranks 0-3 raised ValueError: shape 4 is wrong. All ranks were stopped."
    assert set(info.value.tracebacks) == {0, 1, 2, 3}


def test_ranks_text():
    assert watch.ranks_text([2]) == "rank 2"
    assert watch.ranks_text([1, 0]) == "ranks 0, 1"
    assert watch.ranks_text([0, 1, 2, 3, 5, 7, 8]) == "ranks 0-3, 5, 7, 8"


@pytest.mark.parametrize("make, what", [
    (lambda tmp: open(os.path.join(tmp, "f.txt"), "w"), "an open file"),
    (lambda tmp: [1, {"g": (i for i in range(3))}], "a generator"),
    (lambda tmp: __import__("socket").socket(), "a socket"),
])
def test_results_that_cannot_mean_the_same_in_the_caller_are_refused(make, what, tmp_path):
    def f():
        return make(str(tmp_path))

    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(f, world_size=2)
    msg = str(info.value)
    assert f"raised TypeError: fn returned {what}" in msg and "its result could not be sent back" in msg


def test_absurd_world_sizes_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="world_size=1000 is more than pplab starts on one machine"):
        pplab.launch(lambda: None, world_size=1000)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        with pytest.raises(ValueError, match=r"needs about \d+ open files .* may open only 64 \(`ulimit -n`\)"):
            pplab.launch(lambda: None, world_size=40)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not descendants()


def test_oversubscription_warns(monkeypatch):
    monkeypatch.setattr(pplab.runtime.launcher, "RANKS_PER_CORE", 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with pytest.warns(RuntimeWarning, match="world_size=2 on 1 CPU core"):
        assert pplab.launch(lambda: 1, world_size=2) == [1, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pplab.launch(lambda: 1, world_size=1)


def test_default_timeout_comes_from_the_environment(monkeypatch):
    def hang():
        import time
        time.sleep(300)

    monkeypatch.setenv("PPLAB_LAUNCH_TIMEOUT", "2")
    with pytest.raises(pplab.LaunchError, match=r"still running after 2 s \(timeout=2\)"):
        pplab.launch(hang, world_size=2)
    monkeypatch.setenv("PPLAB_LAUNCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="PPLAB_LAUNCH_TIMEOUT='soon' must be a number of seconds"):
        pplab.launch(hang, world_size=2)
    assert pplab.launch(lambda: 3, world_size=1, timeout=30) == [3]     # timeout= wins


def test_the_ranks_meet_in_the_folder_the_environment_names(monkeypatch, tmp_path):
    def inside(folder):                 # what a rank sees there while the launch runs
        return sorted(os.listdir(folder))

    meet = tmp_path / "meet"
    monkeypatch.setenv("PPLAB_LAUNCH_DIR", str(meet))
    with pytest.raises(ValueError, match=r"PPLAB_LAUNCH_DIR='.*meet' must name a folder this process can write to"):
        pplab.launch(inside, str(meet), world_size=2)
    meet.mkdir()
    seen = pplab.launch(inside, str(meet), world_size=2)
    assert seen[0] == seen[1] and len(seen[0]) == 1 and seen[0][0].startswith(f"pplab-launch-{os.getpid()}-")
    assert list(meet.iterdir()) == []                               # removed after


def test_a_dying_rank_leaves_no_cpp_noise(capfd):
    """A rank killed mid-collective: the others' C++ layers must not flood stderr."""
    def f():
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        for _ in range(3):
            pplab.comm.all_reduce(torch.ones(10))

    with pytest.raises(pplab.LaunchError, match="rank 1 exited without returning a result"):
        pplab.launch(f, world_size=4, timeout=60)
    _, err = capfd.readouterr()
    assert "TCPStore" not in err and "Connection reset by peer" not in err, err[-2000:]


def test_board_reads_only_whole_slots(tmp_path):
    """A slot being written (odd version) reads as empty, never as half a call."""
    path = callboard.create(str(tmp_path / "board"), 2)
    callboard.attach(path, 1)
    try:
        callboard.enter("all_reduce", torch.ones(3), None, (0, 1))
        board = callboard.read(path, 2)
        assert board[1]["inside"] and board[1]["call"]["kind"] == "all_reduce" and not board[0]["inside"]
        assert board[1]["call"]["shape"] == [3] and board[1]["call"]["index"] == 0 and not board[1]["last"]
        callboard.leave()
        callboard.enter("send", torch.ones(2), None, (0, 1), collective=False, dst=0)
        board = callboard.read(path, 2)
        assert board[1]["call"]["kind"] == "send" and board[1]["last"]["kind"] == "all_reduce"
        callboard.leave()
        assert not callboard.read(path, 2)[1]["inside"] and callboard.read(path, 2)[1]["last"]["index"] == 0
        with open(path, "r+b") as f:                    # pretend the rank is half-way through a write
            f.seek(callboard.SLOT)
            f.write(callboard._HEAD.pack(7, 1, 0.0))
        assert not callboard.read(path, 2)[1]["inside"]
    finally:
        callboard._state["mm"] = None
