"""The process that runs torch's DDP tests for test_suite.py, one request at a time.

    python tests/torch_suite/worker.py      # reads requests on stdin, answers on stdout

test_suite.py starts one per pytest session. It imports torch's test module
(torch/testing/_internal/distributed/distributed_test.py) once, so pytest's own
process never sees that module's import-time side effects, and then, for each
request {"test": name, "impl": "torch" | "minddp", "timeout": s, "log": path},
runs that test method the way upstream's test_distributed_spawn.py does
(TestDistBackend: 2 ranks, gloo, file init) with two changes:
- the ranks are forked from this process, which has imported everything and
  never run a torch op, instead of spawned (each spawn re-imports torch and the
  test module: seconds per rank);
- a hard timeout per test: a world still running after it is a failure that
  carries every live rank's Python stack; a rank that raises or dies gets the
  others killed at once and its traceback into the answer.
For impl "minddp" each rank, right after the fork, puts
minddp.DistributedDataParallel in place of torch's class wherever the test
module looks it up (swap_in_minddp). Ranks write their output to `log`.
Answers: {"outcome": "passed" | "failed" | "skipped" | "missing", "message": str}.
"""
import faulthandler
import inspect
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
import types
import unittest

# Answers go to a private copy of stdout; fd 1 itself goes to stderr, so that
# nothing printed while importing (or by a test) can garble them.
_ANSWERS = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)

WORLD_SIZE = 2
# torch's test module reads BACKEND and WORLD_SIZE when imported. The suite is
# the CPU one: on a machine with a GPU, torch's harness would otherwise skip
# every test for want of one GPU per rank.
os.environ.update(BACKEND="gloo", WORLD_SIZE=str(WORLD_SIZE), CUDA_VISIBLE_DEVICES="")
os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "1")

try:
    import expecttest  # torch's common_utils subclasses its TestCase
except ImportError:
    # A test-only dependency of torch's test helpers that the venv may lack; no
    # DDP test uses its one feature (assertExpectedInline), so a bare
    # unittest.TestCase stands in for it.
    expecttest = types.ModuleType("expecttest")
    expecttest.TestCase = unittest.TestCase
    sys.modules["expecttest"] = expecttest

import torch  # noqa: E402
import torch.nn.parallel  # noqa: E402
from torch.testing._internal import common_distributed  # noqa: E402
from torch.testing._internal.distributed import distributed_test as upstream  # noqa: E402

from ported import PortedDDPTests  # noqa: E402

try:
    # Imported here once rather than in every rank; a minddp that does not
    # import fails its own tests (swap_in_minddp raises this), not torch's.
    import minddp
    _MINDDP_IMPORT_ERROR = None
except Exception:  # noqa: BLE001 - reported by every minddp test instead
    minddp = None
    _MINDDP_IMPORT_ERROR = traceback.format_exc()

_FORK = multiprocessing.get_context("fork")
_TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel  # never swapped
_SKIP_CODES = {skip.exit_code: skip.message for skip in common_distributed.TEST_SKIPS.values()}
_ERROR_CODE = common_distributed.MultiProcessTestCase.TEST_ERROR_EXIT_CODE


def swap_in_minddp():
    """Make every name torch's test module uses for DDP mean minddp's class.

    The module imported the class by name (`DistributedDataParallel(...)`) and
    also reaches it as `nn.parallel.DistributedDataParallel`.
    torch.nn.parallel.distributed keeps torch's class: torch's own code there
    (and isinstance checks in torch) must still find it.
    """
    if minddp is None:
        raise ImportError(f"minddp did not import:\n{_MINDDP_IMPORT_ERROR}")
    upstream.DistributedDataParallel = minddp.DistributedDataParallel
    torch.nn.parallel.DistributedDataParallel = minddp.DistributedDataParallel


class _Suite(upstream.TestDistBackend, PortedDDPTests, upstream.DistributedTest._DistTestBase):
    """torch's DDP tests plus our CPU ports of its GPU-only ones (ported.py)."""

    IMPL = None        # "torch" | "minddp", fixed by the subclasses below
    hard_timeout = 60  # seconds; set per request

    @property
    def world_size(self):
        return str(WORLD_SIZE)

    def setUp(self):
        super().setUp()
        self._start_processes(_FORK.Process)

    def tearDown(self):
        super().tearDown()
        # The ranks' FileStore file: left behind when a rank was killed.
        if os.path.exists(self.file_name):
            os.remove(self.file_name)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        # In the forked rank: one intra-op thread each (2 ranks share 2 cores),
        # and the implementation under test in place before the test starts.
        torch.set_num_threads(1)
        faulthandler.enable(all_threads=True)
        if cls.IMPL == "minddp":
            swap_in_minddp()
        assert upstream.DistributedDataParallel is torch.nn.parallel.DistributedDataParallel
        super()._run(rank, test_name, file_name, pipe, **kwargs)

    def _join_processes(self, fn):
        """Wait for the ranks; fail on the first error, death or the hard timeout."""
        deadline = time.monotonic() + self.hard_timeout
        self._exit_order = []  # ranks in the order they exited, to tell causes from effects
        try:
            while len(self._exit_order) < len(self.processes):
                if any(p.exitcode not in (0, None) and p.exitcode not in _SKIP_CODES
                       for p in self.processes):
                    # Give the others a moment to report their own error, then
                    # stop them: they may be blocked on the rank that failed.
                    self._wait_for_exits(time.monotonic() + 0.5)
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(self._hang_report())
                self._wait_for_exits(deadline, first_only=True)
            self._kill_all()
            self._check_codes()
        finally:
            self._kill_all()
            for pipe in self.pid_to_pipe.values():
                pipe.close()

    def _wait_for_exits(self, until, first_only=False):
        """Record ranks as they exit, until `until` (or the first exit)."""
        while len(self._exit_order) < len(self.processes):
            running = {p.sentinel: rank for rank, p in enumerate(self.processes)
                       if rank not in self._exit_order}
            ready = multiprocessing.connection.wait(list(running),
                                                    max(0.0, until - time.monotonic()))
            if not ready:
                return
            self._exit_order += sorted(running[s] for s in ready)
            if first_only:
                return

    def _kill_all(self):
        for p in self.processes:
            if p.exitcode is None:
                p.kill()
        for p in self.processes:
            p.join(5)

    def _hang_report(self):
        live = [r for r, p in enumerate(self.processes) if p.exitcode is None]
        report = (f"HUNG: ranks {live} of {WORLD_SIZE} still running after the hard timeout "
                  f"of {self.hard_timeout}s (a hang is a failure). Their Python stacks:\n")
        for rank in live:
            pipe = self.pid_to_pipe[self.processes[rank].pid]
            try:
                pipe.send(common_distributed.MultiProcessTestCase.Event.GET_TRACEBACK)
                stack = pipe.recv() if pipe.poll(5) else "(no answer)\n"
            except (OSError, EOFError) as e:
                stack = f"(could not ask: {e})\n"
            report += f"--- rank {rank}:\n{_test_frames(stack)}"
        return report

    def _check_codes(self):
        """Raise with every failed rank's traceback, the first to exit first."""
        order = self._exit_order + [r for r in range(len(self.processes))
                                    if r not in self._exit_order]
        report = ""
        for rank in order:
            p = self.processes[rank]
            first = " (the first rank to exit)" if rank == order[0] and len(order) > 1 else ""
            if p.exitcode == _ERROR_CODE:
                pipe = self.pid_to_pipe[p.pid]
                tb = pipe.recv() if pipe.poll(1) else "(no traceback came back)\n"
                report += f"--- rank {rank} raised{first}:\n{tb}"
            elif p.exitcode not in (0, -signal.SIGKILL) and p.exitcode not in _SKIP_CODES:
                how = (f"signal {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                       else f"exit code {p.exitcode}")
                report += f"--- rank {rank} died with {how}{first} (see the ranks' output)\n"
        codes = [p.exitcode for p in self.processes]
        if report:
            raise AssertionError(report)
        if -signal.SIGKILL in codes:
            raise AssertionError(f"ranks were killed with no error of their own: "
                                 f"exit codes {codes}")
        if codes[0] in _SKIP_CODES:
            raise unittest.SkipTest(_SKIP_CODES[codes[0]])


def _test_frames(dump):
    """A faulthandler dump without the thread that made it and without the
    frames below the test method (fork and harness machinery)."""
    kept = []
    for thread in dump.strip().split("\n\n"):
        if "_event_listener" in thread:
            continue
        lines = thread.splitlines()
        below = next((i for i, line in enumerate(lines) if " in run_test" in line), None)
        kept.append("\n".join(lines if below is None else lines[:below]))
    return "\n\n".join(kept) + "\n"


class TorchSuite(_Suite):
    IMPL = "torch"


class MinddpSuite(_Suite):
    IMPL = "minddp"


SUITES = {"torch": TorchSuite, "minddp": MinddpSuite}


def run_one(name, impl, timeout):
    cls = SUITES[impl]
    test = getattr(cls, name, None)
    if not callable(test):
        return {"outcome": "missing",
                "message": f"torch {torch.__version__} has no test {name}"}
    keyword = getattr(test, "needs_torch_keyword", None)
    if keyword is not None and keyword not in inspect.signature(_TORCH_DDP.__init__).parameters:
        return {"outcome": "missing",
                "message": f"torch {torch.__version__}'s DistributedDataParallel has no "
                           f"keyword {keyword}, which {name} is about"}
    cls.hard_timeout = timeout
    case = cls(name)
    result = unittest.TestResult()
    case.run(result)
    if result.skipped:
        return {"outcome": "skipped", "message": result.skipped[0][1]}
    problems = result.errors + result.failures
    if problems:
        return {"outcome": "failed", "message": "\n".join(text for _, text in problems)}
    if not result.wasSuccessful() or result.testsRun != 1:
        return {"outcome": "failed", "message": f"unittest result: {result}"}
    return {"outcome": "passed", "message": ""}


def main():
    TorchSuite.setUpClass()
    _ANSWERS.write(json.dumps({"ready": torch.__version__}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        # Everything this process and its ranks print goes to the request's log.
        sys.stdout.flush()
        sys.stderr.flush()
        with open(request["log"], "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        try:
            answer = run_one(request["test"], request["impl"], request["timeout"])
        except BaseException as e:  # noqa: BLE001 - the parent must hear of it
            answer = {"outcome": "failed",
                      "message": f"harness error: {e!r}\n{traceback.format_exc()}"}
        sys.stdout.flush()
        sys.stderr.flush()
        _ANSWERS.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
