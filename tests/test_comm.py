"""comm.py's CUDA stream protocol, on the CPU, with torch.cuda's stream calls faked.

A queued job on a CUDA engine must run on the engine's stream, after an event
recorded on the submitter's stream at submission, and complete there; a job
whose future has no CUDA device finishes its stream's work first. On a GPU,
tests/test_gpu.py checks what this protocol is for (the job waits for its
submission and nothing after); here the order of the calls is checked, so a
change that drops one fails where CI runs.
"""
import contextlib
import threading

import torch

from minddp import comm


class FakeCuda:
    """Records the stream calls comm.py makes, in order, per thread (the submitter's and
    the engine's run at once), each thread with its own current stream, as CUDA's."""

    def __init__(self):
        self.calls = {}  # thread name -> [call, ...]
        self.engine_streams = []
        self._local = threading.local()

    @property
    def current(self):
        return getattr(self._local, "stream", "default")

    def note(self, *call):
        self.calls.setdefault(threading.current_thread().name, []).append(call)

    def job(self, x):
        """A job that notes the stream it runs on."""
        self.note("job", self.current)
        return x + 1

    def install(self, monkeypatch):
        fake = self

        class Event:
            def record(self, stream):
                self.on = stream
                fake.note("record", stream)

        class Stream:
            def __init__(self, device):
                self.name = f"engine-{len(fake.engine_streams)}"
                fake.engine_streams.append(self)

            def wait_event(self, event):
                fake.note("wait", self.name, event.on)

            def synchronize(self):
                fake.note("synchronize", self.name)

        @contextlib.contextmanager
        def stream(s):
            before, fake._local.stream = fake.current, s.name
            fake.note("enter", s.name)
            try:
                yield
            finally:
                fake._local.stream = before
                fake.note("exit", s.name)

        def set_result(future, value):  # a Future's completion, noted with its stream
            fake.note("done", fake.current)
            set_plain(future, value)

        set_plain = torch.futures.Future.set_result
        monkeypatch.setattr(torch.futures.Future, "set_result", set_result)
        # A Future with a CUDA device needs CUDA: a plain one stands in (the device still
        # decides, inside comm.py, whether the job synchronizes).
        monkeypatch.setattr(comm, "future_on", lambda device=None: torch.futures.Future())
        for name, value in {"Event": Event, "Stream": Stream, "stream": stream,
                            "set_device": lambda device: None,
                            "current_stream": lambda device=None: fake.current}.items():
            monkeypatch.setattr(torch.cuda, name, value)


THREAD = "minddp-test-comm"


def _engine(fake, monkeypatch):
    fake.install(monkeypatch)
    return comm.CommEngine(None, None, torch.device("cpu"), cuda=torch.device("cuda", 0),
                           name=THREAD)


def _engine_calls(fake):
    assert len(fake.engine_streams) == 1, f"{len(fake.engine_streams)} streams: {fake.calls}"
    return fake.engine_streams[0].name, fake.calls.get(THREAD, [])


def test_a_queued_cuda_job_runs_and_completes_on_the_engines_stream(monkeypatch):
    fake = FakeCuda()
    engine = _engine(fake, monkeypatch)
    try:
        assert engine.submit(fake.job, 1, label="test", device=torch.device("cuda", 0)
                             ).wait() == 2
    finally:
        engine.close()
    stream, calls = _engine_calls(fake)
    assert fake.calls[threading.current_thread().name] == [("record", "default")], fake.calls
    # A future on the CUDA device orders its waiters' streams after this one: no
    # synchronize.
    assert calls == [("wait", stream, "default"), ("enter", stream), ("job", stream),
                     ("done", stream), ("exit", stream)], calls


def test_a_device_less_future_completes_after_the_engines_stream(monkeypatch):
    fake = FakeCuda()
    engine = _engine(fake, monkeypatch)
    try:
        assert engine.submit(fake.job, 1, label="test").wait() == 2
        assert engine.run(fake.job, 2, label="test") == 3
    finally:
        engine.close()
    stream, calls = _engine_calls(fake)
    assert fake.calls[threading.current_thread().name] == [("record", "default")] * 2
    one = [("wait", stream, "default"), ("enter", stream), ("job", stream),
           ("synchronize", stream), ("done", stream), ("exit", stream)]
    assert calls == one * 2, calls


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
    assert fake.calls == {threading.current_thread().name: [("job", "default"),
                                                            ("done", "default")]}, fake.calls


def test_a_cpu_engine_makes_no_stream_calls(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    engine = comm.CommEngine(None, None, torch.device("cpu"), name=THREAD)
    try:
        assert engine.submit(fake.job, 6, label="test").wait() == 7
    finally:
        engine.close()
    assert fake.engine_streams == []
    assert fake.calls == {THREAD: [("job", "default"), ("done", "default")]}, fake.calls
