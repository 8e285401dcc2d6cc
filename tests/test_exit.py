"""A training script that ends right after its last backward exits cleanly.

When the interpreter shuts down, the last backward's results may still be
on their way: on the communication thread (our algorithms) or on the
backend's own thread (native, and the used-parameter map of
find_unused_parameters). Before comm.py stopped its engines at exit, such a
script aborted on one rank in about half the runs with "ring" and a quarter
with "native" ("terminate called without an active exception", SIGABRT,
exit status -6). Real interpreter exits are needed, so the ranks are plain
Python processes rather than the harness's workers. The script destroys the
process group before it ends, as a script should: without that, torch's own
groups can abort at exit too.
"""
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from dist_harness import free_port

# One interpreter imports torch and minddp once, then forks two fresh ranks per run
# (importing torch is most of a run's cost on a small machine). Each child leaves the
# loop and runs the script's body at module level, so it ends as any script does: by
# falling off its end into the interpreter's real shutdown, which is what is tested.
SCRIPT = """
import datetime, os, sys, torch, torch.distributed as dist, minddp
import torch._dynamo  # the wrappers' first forward imports it (seconds), as torch's DDP does
algorithm, unused, runs, ports = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
role = None
for run in range(runs):
    children = {}
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            role = (run, rank)
            break
        children[pid] = rank
    if role is not None:
        break
    for pid, rank in children.items():
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            for other in children:  # its peer would wait for it until the group's timeout
                if other != pid:
                    os.kill(other, 9)
            sys.exit(f"run {run}: rank {rank} exited with status {code}")
if role is not None:
    run, rank = role
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=ports[run], WORLD_SIZE="2",
                      RANK=str(rank))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = minddp.DDP(torch.nn.Linear(64, 64), algorithm=algorithm,
                       find_unused_parameters=unused == "unused")
    model(torch.ones(2, 64)).sum().backward()
    dist.destroy_process_group()
"""
RUNS = 6  # at one abort in two per run, all six pass by chance 1.6% of the time


@pytest.mark.parametrize("algorithm, unused", [("ring", "all"), ("native", "unused")])
def test_script_ending_after_backward_exits_cleanly(algorithm, unused):
    # Below the ephemeral range, as the harness's worlds: a port the kernel handed out
    # could be taken by another test's connection in the seconds before a run binds it.
    ports = set()
    while len(ports) < RUNS:
        ports.add(str(free_port()))
    # Its own session, so a timeout kills the forked ranks too; stderr to a file, which
    # no leftover process can hold open the way it would a pipe.
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, algorithm, unused, str(RUNS),
                                 *ports], env=dict(os.environ, OMP_NUM_THREADS="1"),
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            code = proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "none: it did not finish within 150 s"
        err.seek(0)
        assert code == 0, f"{algorithm}: exit status {code}\n{err.read()[-3000:]}"
