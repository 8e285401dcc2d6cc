"""torch's own DDP tests, run against torch's DDP (the control) and against minddp.

    .venv/bin/python -m pytest tests/torch_suite                # both runs
    .venv/bin/python -m pytest tests/torch_suite -k minddp      # minddp's run only
    .venv/bin/python -m pytest tests/torch_suite -k "not minddp"  # the control only

One item per (test, implementation): the tests of torch's
distributed_test.py that selection.py picks, and our CPU ports of its
GPU-gated ones (ported.py), each on 2 gloo ranks on CPU. They run in one
worker process per session (worker.py) that forks a fresh world per test;
a test that runs past its hard timeout is a failure that shows every rank's
stack, and a rank that raises or dies gets its traceback into the report.
Contract: torch's DDP passes every item; minddp too, except the ones in
selection.KNOWN_FAILURES, which run as strict xfails (a fix turns them into
failures until the entry goes).
"""
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from . import selection

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")
START_TIMEOUT = 180  # seconds for the worker to import torch and its test module
GRACE = 60           # beyond a test's own hard timeout, before the worker counts as stuck
MAX_HANGS = 3        # after this many hangs (or failed worker starts), the rest fail at once


def _params():
    for name in selection.UPSTREAM + selection.ported_tests():
        yield pytest.param("torch", name, id=f"torch-{name}")
        cause = selection.KNOWN_FAILURES.get(name)
        marks = [pytest.mark.xfail(strict=True, reason=cause)] if cause else []
        yield pytest.param("minddp", name, marks=marks, id=f"minddp-{name}")


class Worker:
    """worker.py in its own session (so that its ranks die with it), one request at a time."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="minddp-torch-suite-")
        self.stderr_path = os.path.join(self.dir, "worker.log")
        env = dict(os.environ, PYTORCH_PRINT_REPRO_ON_FAILURE="0")
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, env=env,
                                         start_new_session=True, bufsize=0)
        self._pending = b""
        ready = self._read_line(START_TIMEOUT)
        if ready is None:
            self.close()
            raise RuntimeError(f"torch suite worker did not start:\n{self.tail(self.stderr_path)}")

    def run(self, name, impl, timeout):
        """The worker's answer, or None if it died or ran past timeout + GRACE."""
        log = self.log_of(name, impl)
        request = {"test": name, "impl": impl, "timeout": timeout, "log": log}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
        except BrokenPipeError:
            return None
        return self._read_line(timeout + GRACE)

    def log_of(self, name, impl):
        return os.path.join(self.dir, f"{impl}-{name}.log")

    def _read_line(self, timeout):
        deadline = time.monotonic() + timeout
        out = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                return None
            chunk = os.read(out, 65536)
            if not chunk:
                return None
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def close(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def tail(path, chars=8000):
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            return "(no output)"
        return text if len(text) <= chars else "...\n" + text[-chars:]


@pytest.fixture(scope="module")
def worker_pool():
    """The session's worker (started by the first test, restarted after a hang)
    and the tests that hung so far."""
    pool = {"worker": None, "hangs": []}
    yield pool
    if pool["worker"] is not None:
        pool["worker"].close()


def _readable(message):
    """Collapse the C++ frames torch appends to errors (TORCH_SHOW_CPP_STACKTRACES)."""
    lines, out, skipped = message.splitlines(), [], 0
    for line in lines + [""]:
        if re.match(r"\s*#\d+ ", line):
            skipped += 1
            continue
        if skipped:
            out.append(f"    [{skipped} C++ frames left out]")
            skipped = 0
        out.append(line)
    return "\n".join(out).rstrip()


@pytest.mark.parametrize("impl,name", list(_params()))
def test_ddp(impl, name, worker_pool):
    if len(worker_pool["hangs"]) >= MAX_HANGS:
        pytest.fail(f"not run: {MAX_HANGS} tests already hung in this session "
                    f"({', '.join(worker_pool['hangs'])}); look at those first", pytrace=False)
    if worker_pool["worker"] is None:
        try:
            worker_pool["worker"] = Worker()
        except RuntimeError as e:
            worker_pool["hangs"].append(f"worker start for {impl}-{name}")
            pytest.fail(str(e), pytrace=False)
    worker = worker_pool["worker"]
    timeout = selection.TIMEOUTS.get(name, selection.DEFAULT_TIMEOUT)
    answer = worker.run(name, impl, timeout)
    if answer is None:
        message = (f"HUNG or died: the worker gave no answer within {timeout + GRACE}s; killed "
                   f"it and its ranks.\nworker output:\n{worker.tail(worker.stderr_path)}\n"
                   f"ranks' output:\n{worker.tail(worker.log_of(name, impl))}")
        worker_pool["hangs"].append(f"{impl}-{name}")
        worker.close()
        worker_pool["worker"] = None
        pytest.fail(message, pytrace=False)
    outcome, message = answer["outcome"], _readable(answer["message"])
    if outcome == "passed":
        return
    if outcome == "missing":
        pytest.skip(message)
    if outcome == "skipped":
        pytest.skip(f"{name} skipped itself: {message}")
    if "HUNG:" in message:
        worker_pool["hangs"].append(f"{impl}-{name}")
    if "died with" in message or (" raised" not in message and "HUNG:" not in message):
        # A rank died (its fault handler's dump is in its output) or the
        # harness failed: show what the ranks printed.
        message += f"\n--- ranks' output:\n{worker.tail(worker.log_of(name, impl))}"
    pytest.fail(f"{impl} failed {name}:\n{message}", pytrace=False)
