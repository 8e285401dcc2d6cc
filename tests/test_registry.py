"""The public extension API (minddp.register_algorithm / register_codec) and its one registry:
what registration accepts and refuses, and that nothing outside the registry compares names."""
import ast
import os

import pytest
import torch

import minddp
from dist_harness import run_world
from minddp import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made in a test vanish after it."""
    monkeypatch.setattr(registry, "_algorithms", dict(registry._algorithms))
    monkeypatch.setattr(registry, "_codecs", dict(registry._codecs))


def test_builtins_are_registered_through_the_public_door():
    assert registry.algorithm_names()[:6] == ["ring", "tree", "halving_doubling", "native",
                                              "shared_memory", "auto"]
    assert registry.codec_names()[:3] == ["fp16", "bf16", "int8"]
    assert minddp.register_algorithm is registry.register_algorithm
    assert minddp.register_codec is registry.register_codec
    assert "auto" not in registry.algorithm_names(auto_only=True)  # not its own candidate


def test_register_as_decorator_and_as_call(scratch_registry):
    @minddp.register_algorithm("mine")
    def mine(tensor, group):
        return tensor

    assert registry.algorithm("mine").all_reduce is mine
    minddp.register_algorithm("mine_manual", mine, auto=False)
    assert "mine" in registry.algorithm_names(auto_only=True)
    assert "mine_manual" not in registry.algorithm_names(auto_only=True)
    assert "mine_manual" in registry.algorithm_names()


def test_bad_registrations_are_refused(scratch_registry):
    with pytest.raises(ValueError, match="registered already"):
        minddp.register_algorithm("ring", lambda t, g: t)
    with pytest.raises(ValueError, match="identifier"):
        minddp.register_algorithm("my ring", lambda t, g: t)
    with pytest.raises(TypeError, match="callable"):
        minddp.register_algorithm("nope", 3)
    with pytest.raises(TypeError, match="encode and decode"):
        minddp.register_codec("half", encode=lambda t: (t,))
    with pytest.raises(ValueError, match="whole-bucket"):
        minddp.register_codec("powersgd", encode=lambda t: (t,), decode=lambda w: w[0])
    with pytest.raises(ValueError, match="register_algorithm"):
        registry.algorithm("nonesuch")
    with pytest.raises(ValueError, match="register_codec"):
        registry.codec("nonesuch")


def test_a_function_codec_round_trips_and_feeds_back(scratch_registry):
    codec = minddp.register_codec("halves", encode=lambda t: (t.half(),),
                                  decode=lambda w: w[0].float(), error_feedback=True)
    chunk = torch.tensor([1.0, 1e-4 + 1e-8, 70000.0])
    wire = codec.encode(chunk)
    assert [w.dtype for w in wire] == [torch.float16]
    dst = torch.ones(3)
    codec.decode_add_(dst, wire)
    assert torch.equal(dst, 1 + chunk.half().float())
    error = torch.zeros(3)
    codec.encode_with_feedback(chunk.clone(), error)
    assert error[2] == 0  # 70000 -> inf in fp16: not carried on
    assert error[1] == chunk.half().float()[1] - chunk[1]
    assert codec.wire_itemsize(torch.float32) == 2
    assert codec.encode(torch.arange(3))[0].dtype == torch.int64  # passes through


def test_what_an_algorithm_can_carry(scratch_registry):
    minddp.register_algorithm("plain", lambda t, g: t)
    plain, int8, fp16 = (registry.algorithm("plain"), registry.codec("int8"),
                         registry.codec("fp16"))
    assert plain.carries(fp16) is None  # fp16 can be summed whole
    assert "error feedback" in plain.carries(int8)
    with pytest.raises(ValueError, match="cannot carry compression 'int8'"):
        plain.collective(None, int8)
    assert registry.algorithm("ring").carries(int8) is None


def _user_algorithm_everywhere(rank, world_size):
    calls = []

    @minddp.register_algorithm("counted")
    def counted(tensor, pg):  # sums in place, returns nothing, names its group otherwise
        calls.append(tensor.numel())
        torch.distributed.all_reduce(tensor, group=pg)

    t = torch.full((5,), float(rank + 1))
    minddp.all_reduce(t, algorithm="counted")
    model = torch.nn.Linear(4, 2)
    ddp = minddp.DDP(model, algorithm="counted")
    ddp(torch.ones(3, 4)).sum().backward()
    auto = minddp.DDP(torch.nn.Linear(4, 2), algorithm="auto")  # times "counted" too
    return t, len(calls), [p.grad for p in model.parameters()], auto.reducer is not None


def test_a_registered_algorithm_runs_in_all_reduce_the_wrapper_and_auto():
    for t, calls, grads, _ in run_world(_user_algorithm_everywhere, 2):
        assert torch.equal(t, torch.full((5,), 3.0))
        assert calls >= 2 + 2  # all_reduce, the wrapper's bucket, auto's timing of it
        assert all(g is not None for g in grads)


def _a_new_wrapper_after_a_broken_algorithm(rank, world_size):
    @minddp.register_algorithm("broken", auto=False)
    def broken(tensor, pg):  # a researcher's algorithm with a bug: fails on every rank
        raise ValueError("a bug in the algorithm")

    ddp = minddp.DDP(torch.nn.Linear(4, 2), algorithm="broken")
    with pytest.raises(RuntimeError, match="a bug in the algorithm"):
        ddp(torch.ones(3, 4)).sum().backward()
    fixed = torch.nn.Linear(4, 2)  # as under torch's DDP, a new wrapper trains
    ddp = minddp.DDP(fixed, algorithm="ring")
    ddp(torch.full((3, 4), rank + 1.0)).sum().backward()
    return [p.grad for p in fixed.parameters()]


def test_a_new_wrapper_trains_after_an_algorithm_failed():
    grads = run_world(_a_new_wrapper_after_a_broken_algorithm, 2)
    assert all(torch.equal(a, b) for a, b in zip(*grads)), "the ranks' gradients differ"
    assert torch.equal(grads[0][0], torch.full((2, 4), 4.5))  # the mean of 3 and 6


def _trains_again_after_reinitialising(rank, world_size, store_dir, subgroup):
    """destroy_process_group(), init_process_group() on a new store, a new wrapper: as
    under torch's DDP, it trains (the engine of the old world's groups is replaced).
    `subgroup`: the wrappers are over ranks 0 and 1 of 3 (rank 2 builds none), and rank
    1 counts groups of the old world its peer never made: the new world counts afresh,
    as a process that replaced a dead one would."""
    import threading

    import torch.distributed as dist

    from minddp import groups

    sums = []
    for world in range(2):
        if world:
            if subgroup and rank == 1:
                for _ in range(7):
                    groups.number(("group", (0, 1)))
            dist.destroy_process_group()
            store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        model = torch.nn.Linear(4, 2)
        group = dist.new_group([0, 1]) if subgroup else None
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            ddp = minddp.DDP(model, algorithm="ring", process_group=group)
            ddp(torch.full((3, 4), rank + 1.0)).sum().backward()
            sums.append(model.weight.grad)
        # Rank 2 leaves a world only with the others: a rank that destroys its group as
        # soon as init returns can close a connection a slower peer's init still reads.
        dist.barrier()
    threads = sum(t.name == "minddp-comm" for t in threading.enumerate())
    return sums, threads


@pytest.mark.parametrize("subgroup", [False, True])
def test_a_wrapper_trains_after_the_process_group_is_made_again(tmp_path, subgroup):
    results = run_world(_trains_again_after_reinitialising, 3 if subgroup else 2,
                        str(tmp_path), subgroup)
    for sums, threads in results[:2]:  # ranks 0 and 1, the wrappers' (their mean: 4.5)
        assert len(sums) == 2 and all(torch.equal(s, torch.full((2, 4), 4.5)) for s in sums), \
            sums
        assert threads == 1, f"{threads} communication threads: the old one was not stopped"


# Where names must not be compared: the reducer, the wrapper, the seam and the
# algorithms' shared code (registry.py is where names are looked up).
NO_NAMES = ["minddp/ddp.py", "minddp/reducer.py", "minddp/reduction.py", "minddp/arguments.py",
            "minddp/algorithms/__init__.py", "minddp/algorithms/p2p.py",
            "minddp/algorithms/auto.py", "minddp/algorithms/cost_model.py",
            "minddp/compression/__init__.py"]


def _compared_names(source, names):
    """(line, name) of each comparison of a literal name, but bucket_cap_mb="auto"'s."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            if "cap" in ast.unparse(node):  # bucket_cap_mb == "auto": not an algorithm
                continue
            for part in [node.left, *node.comparators]:
                values = part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
                found += [(node.lineno, v.value) for v in values
                          if isinstance(v, ast.Constant) and v.value in names]
    return found


def test_no_algorithm_or_codec_name_is_compared_outside_the_registry():
    names = set(registry.algorithm_names()) | set(registry.compression_names())
    found = {path: hits for path in NO_NAMES
             if (hits := _compared_names(open(os.path.join(ROOT, path)).read(), names))}
    assert not found, f"names compared (line, name): {found}"
    assert _compared_names("if a == 'ring' or b in ('x', 'int8'):\n    pass", names) == [
        (1, "ring"), (1, "int8")]  # the check itself sees them


def test_compare_py_rows_for_registered_entries(tmp_path, scratch_registry):
    from benchmarks import configs
    plugin = tmp_path / "mine.py"
    plugin.write_text("import minddp\n"
                      "minddp.register_algorithm('scratch_sum', lambda t, g: t)\n"
                      "minddp.register_codec('scratch8', encode=lambda t: (t,),\n"
                      "                      decode=lambda w: w[0])\n")
    first = registry.algorithm_names(per_hop_only=True)[0]
    assert configs.load_plugins([str(plugin)]) == ["minddp_scratch_sum",
                                                   f"minddp_{first}_scratch8"]
    assert configs.how_to_build("minddp_scratch_sum") == ("minddp", "scratch_sum", None)
    assert configs.how_to_build("minddp_halving_doubling_fp16") == ("minddp", "halving_doubling",
                                                                    "fp16")
    assert configs.how_to_build("minddp_nonesuch") is None
    with pytest.raises(SystemExit, match="minddp_<algorithm>"):
        configs.check_names(["minddp_nonesuch"])


def test_a_function_codec_says_what_it_returned_wrong(scratch_registry):
    listy = minddp.register_codec("listy", encode=lambda t: t.half(),
                                  decode=lambda w: w[0].float())
    with pytest.raises(TypeError, match="tuple of tensors"):
        listy.encode(torch.ones(4))
    short = minddp.register_codec("short", encode=lambda t: (t.half(),),
                                  decode=lambda w: w[0][:-1].float())
    with pytest.raises(ValueError, match="decode returned 3 elements for a chunk of 4"):
        short.decode_(torch.ones(4), short.encode(torch.ones(4)))


def test_a_function_codec_wire_is_contiguous_and_decodes_any_shape(scratch_registry):
    # encode returns a transposed (strided) view; decode returns a 2-D tensor
    codec = minddp.register_codec(
        "strided", encode=lambda t: (t.reshape(2, -1).t().half(),),
        decode=lambda w: w[0].t().float())
    chunk = torch.arange(6.0)
    wire = codec.encode(chunk)
    assert all(w.is_contiguous() for w in wire)
    dst = torch.zeros(6)
    codec.decode_(dst, wire)
    assert torch.equal(dst, chunk)
