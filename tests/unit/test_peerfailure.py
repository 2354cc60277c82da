import pytest

from coordinator.peerfailure import peer_failure

pytestmark = pytest.mark.unit

# The lines SGLang 0.5.23's workers logged over gloo when rank 0's scheduler was killed -9 (the tier's
# scenario 4a), as journald holds them: one traceback line per entry.
GLOO_CLOSED = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
               "closed by peer [192.168.241.11]:42374. This is typically caused by a remote worker crashing. Check "
               "the logs of the remote worker before reporting an error. G")
GLOO_RESET = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[192.168.241.11]:42374: Connection reset by peer. This is typically caused by a remote worker "
              "hanging or bugs in the application. Check the logs of the remot")
TRACEBACK = ["[2026-12-06 04:41:34 TP1] Scheduler hit an exception: Traceback (most recent call last):",
             '  File "/opt/dsv41-engine/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line '
             "3151, in broadcast", "    work.wait()"]


@pytest.mark.parametrize("line, said", [
    (GLOO_CLOSED, "Connection closed by peer [192.168.241.11]:42374"),
    (GLOO_RESET, "Read error [192.168.241.11]:42374: Connection reset by peer"),
    # NCCL's ncclRemoteError string, and its socket transport's
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or "
     "there was a network error, NCCL version 2.27.5", "torch.distributed.DistBackendError: NCCL error in: "
     "ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version 2.27.5"),
    ("ncclRemoteError: socketProgress: Connection closed by remote peer spark2<45678>",
     "ncclRemoteError: socketProgress: Connection closed by remote peer spark2<45678>"),
])
def test_a_collective_that_lost_a_peer_is_found_in_the_ranks_output(line, said):
    assert peer_failure(TRACEBACK + [line, "Received sigquit from a child process."]) == said


def test_lines_that_do_not_say_a_collective_lost_a_peer():
    assert peer_failure(TRACEBACK) == ""
    # an HTTP client's reset connection names no collective library
    assert peer_failure(["ConnectionResetError: [Errno 104] Connection reset by peer"]) == ""
    # a collective's error that is not a peer's loss (its own fault) is not evidence either
    assert peer_failure(["RuntimeError: [gloo/transport/tcp/pair.cc:300] Connection refused"]) == ""
    assert peer_failure([]) == ""


def test_the_first_such_line_is_kept_and_a_long_one_is_cut():
    assert peer_failure([GLOO_RESET, GLOO_CLOSED]).startswith("Read error")
    assert len(peer_failure(["NCCL: remote process exited or there was a network error " + "x" * 500])) == 200
