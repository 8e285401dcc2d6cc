"""All-reduce algorithms against the plain sum: exact, bitwise equal on every rank, right pattern.

Spawning a world is the slow part, so one world per world size runs every
case (algorithms x sizes x dtypes, segmented runs, codecs, non-contiguous
input, the send pattern) and returns what the parent checks. Inputs are small
integers, so every sum is exact in every dtype, whatever the order. These run
on gloo; NCCL's rules are tested through a strict double (test_backend_rules.py).
"""
import contextlib
import dataclasses
import hashlib
import logging
import os
import time
import types

import pytest
import torch
import torch.distributed as dist

import minddp
from minddp import registry
from minddp.algorithms import auto, cost_model, lanes, p2p, ring, tree
from dist_harness import run_world, time_auto_briefly

# minddp's send/recv algorithms (p2p.py), whose send patterns and segments this file checks:
# not every per-hop one (shared memory carries codecs too, through memory, not messages).
OURS = [n for n in registry.algorithm_names() if registry.algorithm(n).runs_on is p2p.runs_on]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def _values(rank, numel, dtype):
    # Small integers (0..10): sums over 8 ranks stay exact even in bfloat16.
    return ((torch.arange(numel) * 7 + rank * 5) % 11).to(dtype)


def _expected(world_size, numel, dtype):
    return sum(_values(r, numel, torch.int64) for r in range(world_size)).to(dtype)


def _digest(tensor):
    return hashlib.sha1(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class _IdentityCodec:
    """Sends plain copies: proves every hop goes through encode/decode."""

    def __init__(self):
        self.calls = {"encode": 0, "decode_add_": 0, "decode_": 0}

    def encode(self, chunk):
        self.calls["encode"] += 1
        return [chunk.clone()]

    def decode_add_(self, dst, wire):
        self.calls["decode_add_"] += 1
        dst.add_(wire[0])

    def decode_(self, dst, wire):
        self.calls["decode_"] += 1
        dst.copy_(wire[0])

    def wire_itemsize(self, dtype, device=None):
        return dtype.itemsize


class _HalfCodec:
    """Lossy, two wire tensors (fp16 payload and a scale), like the real codecs."""

    def encode(self, chunk):
        scale = chunk.abs().max().clamp(min=1) / 1024 if chunk.numel() else torch.ones(())
        return [(chunk / scale).half(), scale.reshape(1)]

    def decode_add_(self, dst, wire):
        dst.add_(wire[0].float() * wire[1])

    def decode_(self, dst, wire):
        dst.copy_(wire[0].float() * wire[1])

    def wire_itemsize(self, dtype, device=None):
        return 2


def _check_sums(rank, world_size, algorithm, sizes, dtypes):
    for numel in sizes:
        for dtype in dtypes:
            tensor = _values(rank, numel, dtype)
            out = minddp.all_reduce(tensor, algorithm=algorithm)
            assert out is tensor, f"{algorithm} must return its input tensor"
            expected = _expected(world_size, numel, dtype)
            assert torch.equal(tensor, expected), (
                f"{algorithm}, {numel} x {dtype} on {world_size} ranks: rank {rank} got "
                f"{tensor[:8].tolist()}..., expected {expected[:8].tolist()}...")


@contextlib.contextmanager
def _recording():
    """Log (op, peer, tag, group) of every message this rank posts to a process
    group while inside; yields the log."""
    group_type = type(dist.group.WORLD)
    # From the class's own dict: getattr would give an unbound builtin, which
    # restored in its place would no longer receive the group as self.
    originals, log = {op: group_type.__dict__[op] for op in ("send", "recv")}, []

    def recording(op):
        def post(group, tensors, peer, tag):
            # one message per tensor
            log.extend((op, peer, tag, group) for _ in tensors)
            return originals[op](group, tensors, peer, tag)
        return post

    for op in originals:
        setattr(group_type, op, recording(op))
    try:
        yield log
    finally:
        for op, original in originals.items():
            setattr(group_type, op, original)


def _record_sends(rank, world_size):
    """Per algorithm: the (op, peer) of every message this rank posts to a process
    group; under "lanes", (op, peer, posted on the world group itself) of them all."""
    pattern, lanes_used, other_groups = {}, set(), set()
    with _recording() as log:
        for algorithm in OURS:
            log.clear()
            minddp.all_reduce(_values(rank, 2 * world_size + 1, torch.float32), algorithm)
            pattern[algorithm] = [(op, peer) for op, peer, _, _ in log]
            lanes_used.update((op, peer, group is dist.group.WORLD) for op, peer, _, group in log)
            other_groups.update(id(group) for *_, group in log if group is not dist.group.WORLD)
    assert len(other_groups) <= 1, f"rank {rank}: messages went on {len(other_groups)} lanes"
    pattern["lanes"] = sorted(lanes_used)
    return pattern


def _ring_receive_order(rank, world_size):
    """The ring's receives in the order posted, with a window of two segments: the
    all-gather's go up at once, not behind the reduce-scatter's window (their
    messages cannot be written before). Run with tiny segments."""
    with _recording() as log:
        tensor = _values(rank, 1000, torch.float32)
        minddp.all_reduce(tensor, "ring")
    assert torch.equal(tensor, _expected(world_size, 1000, torch.float32))
    tags = [tag for op, _, tag, _ in log if op == "recv"]
    last_add = len(tags) - 1 - tags[::-1].index(ring.REDUCE_SCATTER)
    assert ring.ALL_GATHER in tags[:last_add], (
        f"rank {rank} of {world_size}: the ring's all-gather receives were posted after its "
        f"last reduce-scatter receive: {tags}")


def _grid(rank, world_size):
    time_auto_briefly()
    sizes = [0, 1, max(world_size - 1, 1), 2 * world_size + 1, 1000]
    for algorithm in OURS + ["auto"]:
        _check_sums(rank, world_size, algorithm, sizes, DTYPES)
        if world_size <= 4:  # many segments per chunk; larger worlds run them on tiny segments
            _check_sums(rank, world_size, algorithm, [(1 << 20) + 3], [torch.float32])
    digests = {}
    generator = torch.Generator().manual_seed(rank)
    noise = torch.randn(4099, generator=generator)
    # Tiny segments: the pipelined paths (many segments per chunk) on small data.
    # A window of two segments: the adds wait for free buffers, as large buckets do.
    default_segments = p2p.SEGMENT_BYTES, tree.SEGMENT_BYTES, p2p.WINDOW_BYTES
    p2p.SEGMENT_BYTES, tree.SEGMENT_BYTES, p2p.WINDOW_BYTES = 64, 64, 128
    if world_size > 1:
        _ring_receive_order(rank, world_size)
    for algorithm in OURS:
        _check_sums(rank, world_size, algorithm, [1000, 4099], [torch.float32, torch.int64])
        digests[algorithm] = _digest(minddp.all_reduce(noise.clone(), algorithm))
        identity = _IdentityCodec()
        tensor = _values(rank, 1000, torch.float32)
        registry.algorithm(algorithm).all_reduce(tensor, None, codec=identity)
        assert torch.equal(tensor, _expected(world_size, 1000, torch.float32)), algorithm
        assert world_size == 1 or identity.calls["encode"] > 0, f"{algorithm} bypassed the codec"
        module = registry.algorithm(algorithm)
        lossy = module.all_reduce(noise.clone(), None, codec=_HalfCodec())
        digests[algorithm + "+codec"] = _digest(lossy)
        # (Not torch.testing.assert_close: its first call imports sympy, seconds per rank.)
        error = (lossy - minddp.all_reduce(noise.clone(), algorithm)).abs().max().item()
        assert error < 0.05 * world_size, f"{algorithm} with an fp16 codec: error {error}"
    p2p.SEGMENT_BYTES, tree.SEGMENT_BYTES, p2p.WINDOW_BYTES = default_segments
    for algorithm in OURS:  # and in one segment (the tree's own path for it)
        digests[algorithm + " one segment"] = _digest(minddp.all_reduce(noise.clone(), algorithm))
    chooser = auto.Chooser(dist.group.WORLD, codec=_IdentityCodec())
    tensor = _values(rank, 4099, torch.float32)
    name = chooser.pick(tensor)
    registry.algorithm(name).all_reduce(tensor, dist.group.WORLD, codec=_IdentityCodec())
    assert torch.equal(tensor, _expected(world_size, 4099, torch.float32)), name
    for algorithm in OURS + ["auto"]:
        base = _values(rank, 6 * (world_size + 3), torch.float32).reshape(6, -1)
        minddp.all_reduce(base.t()[::2], algorithm)  # non-contiguous view: every other column
        expected = _expected(world_size, base.numel(), torch.float32).reshape(6, -1)
        expected[:, 1::2] = _values(rank, base.numel(), torch.float32).reshape(6, -1)[:, 1::2]
        assert torch.equal(base, expected), f"{algorithm} on a non-contiguous view"
    return {"digests": digests, "pattern": _record_sends(rank, world_size)}


def _check_pattern(world_size, patterns):
    p = world_size
    q = 1 << (p.bit_length() - 1)
    for r, pattern in enumerate(patterns):
        ring = pattern["ring"]
        assert [m for m in ring if m[0] == "send"] == [("send", (r + 1) % p)] * 2 * (p - 1), (
            f"ring on {p} ranks: rank {r} sent {ring}")
        assert {peer for op, peer in ring if op == "recv"} <= {(r - 1) % p}, ring
        family = {(r - 1) // 2, 2 * r + 1, 2 * r + 2} - {-1}
        expected_tree_sends = (r > 0) + len([c for c in (2 * r + 1, 2 * r + 2) if c < p])
        sends = [peer for op, peer in pattern["tree"] if op == "send"]
        assert set(sends) <= family and len(sends) == expected_tree_sends, (
            f"tree on {p} ranks: rank {r} sent to {sends}")
        extra = p - q
        if r < 2 * extra and r % 2 == 0:
            partners = {r + 1}
        else:
            v = r // 2 if r < 2 * extra else r - extra
            partners = {2 * w + 1 if w < extra else w + extra
                        for w in (v ^ (1 << i) for i in range(q.bit_length() - 1))}
            partners |= {r - 1} if r < 2 * extra else set()
        peers = {peer for _, peer in pattern["halving_doubling"]}
        assert peers <= partners, f"halving_doubling on {p} ranks: rank {r} talked to {peers}"
        # Lanes: data toward a higher rank travels on the group, toward a lower
        # one on its reverse lane, so no gloo connection carries data both ways.
        for op, peer, on_group in pattern["lanes"]:
            upward = (r < peer) == (op == "send")
            assert on_group == upward, (
                f"{p} ranks: rank {r}'s {op} {'to' if op == 'send' else 'from'} rank {peer} "
                f"went on the {'group' if on_group else 'reverse lane'}")


# 1 to 6 ranks, and 8: halving-doubling with one, two and no extra ranks over a power of
# two (3, 5: one; 6: two; 8: none, three rounds). 7 (three extra) added nothing 6 does not.
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 8])
def test_every_size_dtype_and_pattern(world_size):
    results = run_world(_grid, world_size, timeout=150)
    for key, digest in results[0]["digests"].items():
        differ = [r for r, res in enumerate(results) if res["digests"][key] != digest]
        assert not differ, f"{key} on {world_size} ranks: ranks {differ} differ from rank 0"
    if world_size > 1:
        _check_pattern(world_size, [res["pattern"] for res in results])


def _with_dead_peer(rank, world_size, algorithm, numel):
    dist.barrier()  # every rank is past the harness's set-up before one dies
    if rank == 2 or world_size == 2 and rank == 1:
        os._exit(1)  # a peer that dies before the collective
    try:
        minddp.all_reduce(torch.ones(numel), algorithm)
    except RuntimeError as e:
        time.sleep(1)  # let the other survivor fail on its own wait, not on our exit
        return str(e)
    return "no error"


# The tree's single element takes its one-segment path, which posts to the
# process group itself; rank 2 is a child of rank 0 there, as it is rank 0's
# left neighbour in the ring.
@pytest.mark.parametrize("algorithm, numel", [("ring", 1 << 16), ("tree", 1)])
def test_dead_peer_raises_naming_algorithm_and_peer(algorithm, numel):
    messages = run_world(_with_dead_peer, 3, algorithm, numel, timeout=60, pg_timeout=20,
                         expect_dead=(2,))
    for rank, message in enumerate(messages[:2]):
        assert f"{algorithm} all-reduce (rank {rank} of 3)" in message, message
        assert "rank" in message and "timeout" in message, message
    assert "receive from rank 2" in messages[0], messages[0]


def test_dead_peer_in_the_two_rank_exchange():
    # Two ranks and a small tensor: the tree's exchange, its own posts and waits.
    message = run_world(_with_dead_peer, 2, "tree", 1, timeout=60, pg_timeout=20,
                        expect_dead=(1,))[0]
    assert "tree all-reduce (rank 0 of 2)" in message, message
    assert "to rank 1" in message or "from rank 1" in message, message


def _lane_without_peer(rank, world_size):
    dist.barrier()
    if rank == 1:
        os._exit(1)  # gone before the group's reverse lane is opened
    try:
        lanes.open_lanes(dist.group.WORLD)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_lane_that_cannot_open_says_why():
    message = run_world(_lane_without_peer, 2, timeout=60, pg_timeout=10, expect_dead=(1,))[0]
    assert "rank 0 of 2" in message and "reverse lane" in message, message
    assert "timeout" in message and "peer died" in message, message


class _PostingGroup:
    """A process group that completes every message at once and logs its receives."""

    def __init__(self):
        self.received = []

    def send(self, tensors, peer, tag):
        return types.SimpleNamespace(wait=lambda: True)

    def recv(self, tensors, peer, tag):
        self.received.append((tag, tensors[0].data_ptr()))
        return types.SimpleNamespace(wait=lambda: True)


def test_receive_posting_order_on_gloo(monkeypatch):
    # A window of two segments; five adds (tag 1), then sets: two of tag 2,
    # one of tag 1. gloo matches by peer and tag, so the tag-2 sets go up as
    # soon as the window is full; the tag-1 set keeps its place behind the adds.
    monkeypatch.setattr(p2p, "WINDOW_BYTES", 128)
    group = _PostingGroup()
    flat = torch.zeros(16 * 8)
    link = p2p.Link("ring", flat, group, None, 64, 0, 2, "gloo")
    views = link.segments(0, flat.numel())
    recvs = ([(1, views[i], "add", 1) for i in range(5)] +
             [(1, views[5], "set", 2), (1, views[6], "set", 2), (1, views[7], "set", 1)])
    link.exchange([], recvs)
    # Adds land in window buffers, sets straight into their segment.
    into = {views[i].data_ptr(): f"set{i}" for i in (5, 6, 7)}
    posted = [into.get(ptr, f"add{tag}") for tag, ptr in group.received]
    assert all(tag == (1 if name in ("add1", "set7") else 2)
               for (tag, _), name in zip(group.received, posted)), group.received
    assert posted == ["add1", "add1", "set5", "set6", "add1", "add1", "add1", "set7"]


def test_rounds_under_nccl_rules(monkeypatch):
    # NCCL's rules: whole chunks (no segments), one group per round, each
    # round's receives in list order beside that round's sends, and what
    # forward returns for a receive of round k goes in round k + 1.
    groups = []
    monkeypatch.setattr(p2p.dist, "P2POp", lambda op, t, group, group_peer, tag: (
        op.__name__, group_peer, tag, t.data_ptr()))
    monkeypatch.setattr(p2p.dist, "batch_isend_irecv",
                        lambda ops: groups.append(ops) or [types.SimpleNamespace(wait=bool)])
    flat = torch.zeros(40)
    link = p2p.Link("ring", flat, object(), None, 64, 0, 2, "nccl")
    assert link.segments(0, 40) == [flat] and len(link.segments(10, 30)) == 1
    a, b, c = flat[:10], flat[10:20], flat[20:30]
    recvs = [(1, a, "add", 1), (1, b, "set", 2), (1, c, "set", 2)]
    link.exchange([(1, flat[30:], 7)], recvs, forward=lambda i, _: [(1, a, 9)] if i == 0 else [],
                  recv_rounds=[0, 2, 2])
    names = [[(op, tag) for op, _, tag, _ in ops] for ops in groups]
    assert names == [[("isend", 7), ("irecv", 1)], [("isend", 9)],
                     [("irecv", 2), ("irecv", 2)]], names
    assert [ptr for *_, ptr in groups[2]] == [b.data_ptr(), c.data_ptr()]  # straight into place


def test_refuses_sparse_lists_and_unknown_names():
    with pytest.raises(TypeError, match="dense"):
        p2p.run("ring", None, torch.eye(3).to_sparse(), _FakeGroup(2))
    with pytest.raises(TypeError, match="one tensor"):
        p2p.run("ring", None, [torch.ones(2), torch.ones(3)], _FakeGroup(2))
    with pytest.raises(ValueError, match="choose one of"):
        minddp.all_reduce(torch.ones(2), algorithm="butterfly")


class _FakeGroup:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


def test_cost_model_fit_and_choice(caplog, monkeypatch):
    # No backend: every algorithm runs, but shared memory, which needs the ranks on one host
    # (its memory-speed formula would win every size over these network costs).
    monkeypatch.setattr(registry.Algorithm, "can_run",
                        lambda self, group: self.name != "shared_memory")
    sizes = [4, 1 << 10, 1 << 16, 1 << 20]
    alpha, beta = cost_model.fit(sizes, [50e-6 + s * 1e-9 for s in sizes])
    assert alpha == pytest.approx(50e-6) and beta == pytest.approx(1e-9)
    costs = cost_model.Costs(alpha=50e-6, hop=40e-6, beta=1e-9, gamma=2e-10,
                             native_alpha=1e-3, native_beta=5e-9)
    # Few steps win small messages, bandwidth-optimal ones win large ones.
    assert (cost_model.predict("tree", 4, 8, costs) <
            cost_model.predict("ring", 4, 8, costs))
    assert (cost_model.predict("ring", 64 << 20, 8, costs) <
            cost_model.predict("tree", 64 << 20, 8, costs))
    assert (cost_model.predict("halving_doubling", 1 << 20, 8, costs) <
            cost_model.predict("ring", 1 << 20, 8, costs))
    chooser = auto.Chooser(_FakeGroup(6), costs=costs, timed=False)  # not a power of two: ring
    with caplog.at_level(logging.DEBUG, logger="minddp.algorithms"):
        assert chooser.pick(torch.empty(64 << 20, dtype=torch.uint8)) == "ring"
        assert chooser.pick(torch.empty(64 << 20, dtype=torch.uint8)) == "ring"
    assert len(caplog.records) == 1 and "-> ring" in caplog.text
    # Without native, a codec-carrying auto never picks it, however cheap.
    cheap_native = cost_model.Costs(50e-6, 40e-6, 1e-9, 2e-10, 0.0, 0.0)
    assert auto.Chooser(_FakeGroup(4), codec=_IdentityCodec(), costs=cheap_native,
                        timed=False).pick(
        torch.empty(1)) != "native"
    assert auto.Chooser(_FakeGroup(4), costs=cheap_native, timed=False).pick(
        torch.empty(1)) == "native"


def test_auto_leaves_cuda_tensors_on_gloo_to_the_backend(monkeypatch):
    """Ranks sharing a GPU over gloo: auto sends CUDA tensors to the backend's all-reduce
    without timing (its timing on an idle GPU misjudged them, auto.py), CPU tensors of the
    same size still to the model's pick; not with a codec, nor on another backend."""
    monkeypatch.setattr(registry.Algorithm, "can_run",
                        lambda self, group: self.name != "shared_memory")
    monkeypatch.setattr(auto.devices, "backend_of", lambda group: "gloo")
    slow_native = cost_model.Costs(alpha=50e-6, hop=40e-6, beta=1e-9, gamma=2e-10,
                                   native_alpha=1e-3, native_beta=5e-9)
    on_gpu = types.SimpleNamespace(is_cuda=True, nbytes=64 << 20)
    chooser = auto.Chooser(_FakeGroup(4), costs=slow_native)  # timed: would run collectives
    assert chooser.pick(on_gpu) == "native"
    chooser.tune([on_gpu])
    assert chooser._picked == {}  # nothing timed or modelled for it
    untimed = auto.Chooser(_FakeGroup(4), costs=slow_native, timed=False)
    assert untimed.pick(torch.empty(64 << 20, dtype=torch.uint8)) not in ("native", None)
    assert untimed.pick(on_gpu) == "native"
    coded = auto.Chooser(_FakeGroup(4), codec=_IdentityCodec(), costs=slow_native, timed=False)
    assert coded.pick(on_gpu) != "native"
    monkeypatch.setattr(auto.devices, "backend_of", lambda group: "nccl")
    assert auto.Chooser(_FakeGroup(4), costs=slow_native, timed=False).pick(on_gpu) != "native"


def _rounds(**rows):
    names = list(rows)
    return torch.tensor([rows[n] for n in names], dtype=torch.float64), names


def test_auto_picks_the_lowest_score_and_favours_no_side():
    ring = [1.0] * 8
    assert auto._fastest(*_rounds(native=[1.04] * 8, ring=ring, tree=[2.0] * 8)) == "ring"
    assert auto._fastest(*_rounds(ring=[1.04] * 8, native=ring, tree=[2.0] * 8)) == "native"
    assert auto._fastest(*_rounds(ring=ring, tree=[0.9] * 8)) == "tree"
    # A tie goes to the first candidate named.
    assert auto._fastest(*_rounds(ring=ring, native=ring)) == "ring"
    assert auto._fastest(*_rounds(native=ring, ring=ring)) == "native"


def test_auto_scores_each_round_against_its_best():
    # ring takes 0.8x native's time in every round but one; slow spells (x3)
    # hit ring in rounds 0-4 and native in rounds 0-3 only. Plain medians
    # would pick native; per-round ratios see through the spells.
    ring = torch.tensor([2.4] * 5 + [0.8] * 4, dtype=torch.float64)
    native = torch.tensor([3.0] * 4 + [1.0] * 5, dtype=torch.float64)
    assert native.median() < ring.median(), "the example must fool plain medians"
    scores = auto._relative(torch.stack([ring, native]), ["ring", "native"])
    assert scores == pytest.approx({"ring": 1.0, "native": 1.25})
    assert auto._fastest(torch.stack([ring, native]), ["ring", "native"]) == "ring"


def _timed_choice_overrules_the_model(rank, world_size):
    # The model says the tree wins small messages by far; make it the slowest.
    costs = cost_model.Costs(alpha=1e-3, hop=1e-6, beta=1e-9, gamma=1e-10,
                             native_alpha=1e-3, native_beta=1e-9)
    real_tree = tree.all_reduce

    def slow_tree(tensor, group=None, codec=None):
        time.sleep(0.02)
        return real_tree(tensor, group, codec)

    registered = registry._algorithms["tree"]
    registry._algorithms["tree"] = dataclasses.replace(registered, all_reduce=slow_tree)
    try:
        model_only = auto.Chooser(dist.group.WORLD, costs=costs, timed=False)
        timed = auto.Chooser(dist.group.WORLD, costs=costs)
        tensor = torch.ones(16)
        return model_only.pick(tensor), timed.pick(tensor), timed.pick(tensor)
    finally:
        registry._algorithms["tree"] = registered


def test_auto_times_the_candidates_and_drops_a_slow_one():
    for model_pick, timed_pick, again in run_world(_timed_choice_overrules_the_model, 2):
        assert model_pick == "tree"
        assert timed_pick != "tree" and again == timed_pick


def _timing_order(rank, world_size):
    costs = cost_model.Costs(alpha=1e-4, hop=1e-6, beta=1e-9, gamma=1e-10,
                             native_alpha=1e-4, native_beta=1e-9)
    chooser = auto.Chooser(dist.group.WORLD, costs=costs)
    calls = []
    chooser._run = lambda name, tensor: calls.append(name)
    chooser.pick(torch.ones(1024))
    # The timed ones: shared memory is not timed on a bucket this small (its cost says so).
    return calls, [n for n in chooser.names if n in calls]


def test_auto_times_the_candidates_in_a_fresh_order_each_round():
    (calls, names), (other, _) = run_world(_timing_order, 2)
    # Every rank runs them in the same order: each call is a collective.
    assert calls == other
    rounds = [calls[i:i + len(names)] for i in range(0, len(calls), len(names))]
    assert len(rounds) > auto.MIN_ROUNDS and all(sorted(r) == sorted(names) for r in rounds)
    # No candidate always runs right after the same other one (what ran
    # before can slow a call down: a full socket buffer, a cold cache).
    before = {n: {r[r.index(n) - 1] for r in rounds if r.index(n) > 0} for n in names}
    assert all(len(b) > 1 for b in before.values()), before


def _provisional_sizes(rank, world_size):
    costs = cost_model.Costs(alpha=1e-4, hop=1e-6, beta=1e-9, gamma=1e-10,
                             native_alpha=1e-4, native_beta=1e-9)
    chooser = auto.Chooser(dist.group.WORLD, costs=costs)
    timed = []
    chooser._run = lambda name, tensor: timed.append(tensor.numel())
    probe, kept = torch.ones(1024), torch.ones(4096)
    chooser.tune([probe, kept], timed=False)  # the buckets before bucket_cap_mb="auto"'s plan
    before = list(timed)
    in_use = chooser.pick(probe)  # launched before the plan: the model's pick, not timed
    chooser.tune([kept])  # the planned buckets: timed now
    return before, in_use, sorted(set(timed)), chooser.pick(kept) in chooser.names


def test_auto_times_only_the_sizes_it_keeps():
    for before, in_use, timed, picked in run_world(_provisional_sizes, 2):
        assert before == [] and in_use is not None
        assert timed == [4096] and picked


def _slow_link_rounds(rank, world_size, budget):
    import time
    costs = cost_model.Costs(alpha=1e-4, hop=1e-6, beta=1e-9, gamma=1e-10,
                             native_alpha=1e-4, native_beta=1e-9)
    auto.SIZE_BUDGET_S = budget
    chooser = auto.Chooser(dist.group.WORLD, costs=costs)
    calls = []
    # Rank 1 is the slow one: the ranks must still agree on how many rounds to run.
    chooser._run = lambda name, tensor: calls.append(name) or time.sleep(0.01 * (1 + rank))
    chooser.pick(torch.ones(1024))
    return len(calls) // len(set(calls))  # rounds of the timed candidates


def test_auto_times_fewer_rounds_where_one_round_is_slow():
    # One round costs the slowest rank about 0.02 s per candidate: with a 1 s
    # budget, about 1 / (0.02 * candidates) rounds plus the warm-up, not MIN_ROUNDS.
    counts = run_world(_slow_link_rounds, 2, 1.0)
    assert counts[0] == counts[1], "ranks ran different numbers of rounds"
    assert auto.FEWEST_ROUNDS + 1 <= counts[0] < auto.MIN_ROUNDS
    assert run_world(_slow_link_rounds, 2, 0.0) == [auto.FEWEST_ROUNDS + 1] * 2
    unbounded = run_world(_slow_link_rounds, 2, 1e9)  # the budget is all that cut them
    assert unbounded[0] == unbounded[1] and unbounded[0] > auto.MIN_ROUNDS


def _measure_through_spells(rank, world_size, spells):
    # Fake timings: the first `spells` attempts see small messages as slow as
    # large ones (a busy spell), later ones see a sane link.
    calls = []

    def interleaved(fns, repeats, group=None, device=None):
        calls.append(len(fns))
        busy = (len(calls) - 1) // 3 < spells  # three timing rounds per attempt
        if len(fns) == 3:  # small ring, small tree, small native
            return [3e-3, 3e-3, 3e-3] if busy else [3e-4, 2e-4, 3e-4]
        if len(fns) == 1:  # the add
            return [4e-4]
        return [3e-3, 3e-3] if busy else [4e-3, 3e-3]  # large ring, large native
    cost_model.interleaved = interleaved
    costs = cost_model.measure(dist.group.WORLD)
    return len(calls) // 3, costs.beta > 0 and costs.native_beta > 0


def test_cost_model_measures_again_after_impossible_figures():
    assert run_world(_measure_through_spells, 2, 1) == [(2, True)] * 2
    # Never more than ATTEMPTS rounds, even if every one is busy.
    assert run_world(_measure_through_spells, 2, 99) == [(cost_model.ATTEMPTS, False)] * 2


def _rng_untouched(rank, world_size):
    model = torch.nn.Linear(4, 4)  # (building it draws from the RNG, so before seeding)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    minddp.DDP(model, algorithm="auto")  # measures the links
    return torch.equal(torch.rand(3), expected)


def test_auto_measurement_leaves_the_global_rng_alone():
    assert run_world(_rng_untouched, 2) == [True, True]
