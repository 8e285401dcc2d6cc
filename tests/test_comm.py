"""comm.py's CUDA stream protocol, on the CPU, with torch.cuda's stream calls faked.

A queued job on a CUDA engine must run on the engine's stream, after an event
recorded on the submitter's stream at submission, and be marked done on that
stream; a job whose future has no CUDA device finishes its stream's work first.
On a GPU, tests/test_gpu.py checks what this protocol is for (the job waits for
its submission and nothing after); here the order of the calls is checked, so a
change that drops one fails where CI runs.
"""
import contextlib

import torch

from minddp import comm


class FakeCuda:
    """Records, in order, the stream calls comm.py makes and on which thread's stream."""

    def __init__(self):
        self.calls = []
        self.current = "submitter"  # the stream the caller's thread has current
        self.engine_streams = []

    def job(self, x):
        """A job that notes the stream it runs on."""
        self.calls.append(("job", self.current))
        return x + 1

    def install(self, monkeypatch):
        fake = self

        class Event:
            def record(self, stream):
                self.on = stream
                fake.calls.append(("record", stream))

        class Stream:
            def __init__(self, device):
                self.name = f"engine-{len(fake.engine_streams)}"
                fake.engine_streams.append(self)

            def wait_event(self, event):
                fake.calls.append(("wait", self.name, event.on))

            def synchronize(self):
                fake.calls.append(("synchronize", self.name))

        @contextlib.contextmanager
        def stream(s):
            before, fake.current = fake.current, s.name
            fake.calls.append(("enter", s.name))
            try:
                yield
            finally:
                fake.current = before
                fake.calls.append(("exit", s.name))

        for name, value in {"Event": Event, "Stream": Stream, "stream": stream,
                            "set_device": lambda device: None,
                            "current_stream": lambda device=None: fake.current}.items():
            monkeypatch.setattr(torch.cuda, name, value)


def _engine(fake, monkeypatch):
    fake.install(monkeypatch)
    return comm.CommEngine(None, None, torch.device("cpu"), cuda=torch.device("cuda", 0),
                           name="minddp-test-comm")


def test_a_queued_cuda_job_runs_on_the_engines_stream_after_its_submission(monkeypatch):
    fake = FakeCuda()
    engine = _engine(fake, monkeypatch)
    try:
        assert engine.submit(fake.job, 1, label="test").wait() == 2
        assert engine.run(fake.job, 2, label="test") == 3
    finally:
        engine.close()
    assert len(fake.engine_streams) == 1, f"{len(fake.engine_streams)} streams made: {fake.calls}"
    stream = fake.engine_streams[0].name
    one = [("record", "submitter"), ("wait", stream, "submitter"), ("enter", stream),
           ("job", stream), ("synchronize", stream), ("exit", stream)]
    # A future without a CUDA device: the stream's work is finished before it completes.
    assert fake.calls == one * 2, fake.calls


def test_a_nonblocking_job_run_on_the_callers_thread_takes_its_stream(monkeypatch):
    fake = FakeCuda()
    engine = _engine(fake, monkeypatch)
    try:
        def job(x):
            return fake.job(x)

        job.nonblocking = True  # the backend's asynchronous all-reduce, with nothing queued
        assert engine.submit(job, 5, label="test").wait() == 6
    finally:
        engine.close()
    assert fake.calls == [("job", "submitter")], fake.calls


def test_a_cpu_engine_makes_no_stream_calls(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    engine = comm.CommEngine(None, None, torch.device("cpu"), name="minddp-test-comm")
    try:
        assert engine.submit(lambda: 7, label="test").wait() == 7
    finally:
        engine.close()
    assert fake.calls == [] and fake.engine_streams == []
