"""The replica check (minddp/replicas.py): a one-bit difference in one rank's weights raises
on every rank within the interval, naming the parameter and the ranks; equal replicas never
raise, whatever the wrapper is doing (BatchNorm, no_sync, a comm hook, join, unused
parameters, static_graph); check_replicas=0 checks nothing."""
import struct

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import minddp
from minddp import replicas
from minddp.model_sync import ModelMismatch
from dist_harness import run_world
from models import MODELS, batch


# -- the checksum --------------------------------------------------------------
def _reference_checksum(tensor):
    """The same sum in plain Python: int64 words, wrapped, plus the trailing bytes."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).tolist()
    data = bytes(raw)
    words = len(data) // 8
    total = sum(struct.unpack(f"<{words}q", data[:words * 8])) + sum(data[words * 8:])
    total %= 2**64
    return total - 2**64 if total >= 2**63 else total


@pytest.mark.parametrize("dtype,numel", [(torch.float32, 1001), (torch.float16, 37),
                                         (torch.bfloat16, 8), (torch.float64, 5),
                                         (torch.float32, 1)])
def test_checksum_matches_the_reference_and_sees_every_single_bit(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=g) * 1e30).to(dtype)  # large words: sums wrap
    base = replicas.checksum(t).item()
    assert base == _reference_checksum(t)
    bits = t.element_size() * 8
    flat = t.view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                            8: torch.int64}[t.element_size()])
    for element in {0, numel // 2, numel - 1}:
        for bit in range(bits):
            flipped = flat.clone()
            flipped[element] ^= flipped.new_tensor(1).bitwise_left_shift(bit)
            assert replicas.checksum(flipped.view(dtype)).item() != base, (element, bit)


def test_checksum_is_exact_where_a_float_sum_is_not():
    t = torch.full((1 << 16,), 1.0)
    flipped = t.clone()
    flipped.view(torch.int32)[7] ^= 1  # the lowest mantissa bit: 1 + 2**-23
    assert t.sum() == flipped.sum()  # a float checksum cannot see it
    assert replicas.checksum(t) != replicas.checksum(flipped)


def test_checksum_of_views_off_a_word_boundary():
    big = torch.randn(103)
    for start in range(4):
        view = big[start:start + 97]
        assert replicas.checksum(view).item() == _reference_checksum(view.clone())
    strided = torch.randn(3, 8)[:, ::2]  # a parameter may be one: its bytes are not in a row
    assert replicas.checksum(strided).item() == _reference_checksum(strided.contiguous())


def test_differences_compare_present_ranks_only():
    rows = [[1, 5, 6], [0, 0, 0], [1, 5, 7], [1, 5, 6]]
    assert replicas.differences(rows) == ([0, 2, 3], [1])
    assert replicas.differences([[1, 5, 6], [0, 0, 0]]) == ([0], [])


@pytest.mark.parametrize("value", [-1, 2.5, "10", True])
def test_check_replicas_must_be_a_number_of_steps(value):
    with pytest.raises(ValueError, match="check_replicas must be a whole number"):
        replicas.interval_of(value, 0)
    assert replicas.interval_of(None, 0) == 0 and replicas.interval_of(7, 0) == 7


# -- a rank whose weights changed alone ----------------------------------------
def _flip(param, element, bit):
    with torch.no_grad():
        words = param.data.view(-1).view(torch.int32)
        words[element] ^= 1 << bit if bit < 31 else -(1 << 31)


def _diverge(rank, world_size, culprit, flip_after, bit, interval, name="deep",
             target="layers.4.weight", steps=12, **kwargs):
    """Train; after step `flip_after`'s optimizer step (0: before the first step), flip
    one bit of `target` on rank `culprit`. Returns (the step whose backward raised, its
    message), or (None, the weights) if none did."""
    torch.manual_seed(0)
    ddp = minddp.DDP(MODELS[name](), check_replicas=interval, **kwargs)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.05)
    for step in range(1, steps + 1):
        if step == flip_after + 1 and rank == culprit:
            _flip(dict(ddp.module.named_parameters())[target], 5, bit)
        opt.zero_grad()
        loss = ddp(*batch(name, rank, step)).square().mean()
        try:
            loss.backward()
        except replicas.ReplicasDiverged as e:
            with pytest.raises(RuntimeError, match="replicas diverged"):
                ddp(*batch(name, rank, step))  # the wrapper is broken from then on
            return step, str(e)
        opt.step()
    return None, [p.detach().clone() for p in ddp.module.parameters()]


def _same_error_everywhere(results):
    steps = {step for step, _ in results}
    assert len(steps) == 1 and None not in steps, f"not every rank raised: {results}"
    bodies = {message.split(":", 1)[1] for _, message in results}
    assert len(bodies) == 1, "the ranks raised different errors"
    return steps.pop(), results[0][1]


@pytest.mark.parametrize("bit", [0, 22, 31])
def test_one_flipped_bit_raises_on_every_rank_naming_parameter_and_rank(bit):
    # interval 4: checks at synced steps 1, 5, 9; flipped after step 5, found at 9.
    step, message = _same_error_everywhere(run_world(_diverge, 2, 1, 5, bit, 4))
    assert step == 9
    for words in ("replicas diverged at synced step #9", "'layers.4.weight'",
                  "ranks that differ from it: [1]", "agree with rank 0: [0]",
                  "equal at the previous check (synced step #5)", "1 of 14 parameters",
                  "if rank == 0", "checkpoint", "flipped bit", "check_replicas"):
        assert words in message, (words, message)


def test_the_step_before_a_check_is_enough():
    # flipped right before the check's step: nothing happens to it in between
    step, message = _same_error_everywhere(run_world(_diverge, 2, 0, 4, 0, 4))
    assert step == 5 and "ranks that differ from it: [1]" in message


def test_three_ranks_the_odd_one_out_is_named():
    step, message = _same_error_everywhere(run_world(_diverge, 3, 0, 2, 3, 1, timeout=90))
    assert step == 3
    assert "agree with rank 0: [0]; ranks that differ from it: [1, 2]" in message
    assert "{0} | {1, 2}" in message


def test_a_frozen_parameter_is_checked_and_an_ignored_one_is_not():
    _, message = _same_error_everywhere(
        run_world(_diverge, 2, 1, 1, 9, 1, "frozen", "frozen.weight", 4))
    assert "'frozen.weight'" in message
    results = run_world(_ignored, 2)
    assert not torch.equal(*results)  # the ignored weight differs, and nothing raised


def _ignored(rank, world_size):
    torch.manual_seed(0)
    model = MODELS["deep"]()
    minddp.DDP._set_params_and_buffers_to_ignore_for_model(model, ["head.bias"])
    ddp = minddp.DDP(model, check_replicas=1)
    assert "head.bias" not in ddp.reducer.replicas.names
    if rank == 1:
        _flip(model.head.bias, 0, 3)
    for step in range(3):
        ddp(*batch("deep", rank, step)).sum().backward()
    assert ddp.reducer.replicas.passed == 3
    return model.head.bias.detach().clone()


def test_off_checks_nothing():
    # flipped before the first step, which any interval checks
    results = run_world(_diverge, 2, 1, 0, 22, 0, "deep", "layers.4.weight", 4)
    assert [step for step, _ in results] == [None, None]
    assert not torch.equal(results[0][1][4], results[1][1][4])  # they did diverge


def test_different_intervals_are_refused_at_construction():
    results = run_world(_two_intervals, 2)
    assert all("check_replicas=10 on rank 0 but 20 on rank 1" in m for m in results), results


def _two_intervals(rank, world_size):
    with pytest.raises(ModelMismatch) as e:
        minddp.DDP(nn.Linear(4, 4), check_replicas=10 if rank == 0 else 20)
    return str(e.value)


def test_a_divergence_under_join_raises_on_the_joined_rank_too():
    results = run_world(_diverge_in_join, 3, timeout=90)
    bodies = {message.split(":", 1)[1] for message in results}
    assert len(bodies) == 1, results
    for words in ("'head.weight'", "agree with rank 1: [1]; ranks that differ from it: [2]",
                  "ranks [0] have joined (uneven inputs) and were not compared"):
        assert words in results[0], (words, results[0])


def _diverge_in_join(rank, world_size):
    torch.manual_seed(0)
    ddp = minddp.DDP(MODELS["deep"](), check_replicas=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with pytest.raises(replicas.ReplicasDiverged) as e:
        with ddp.join():
            for step in range(2 if rank == 0 else 6):
                opt.zero_grad()
                ddp(*batch("deep", rank, step)).square().mean().backward()
                opt.step()
                if step == 3 and rank == 2:  # rank 0 has joined by now
                    _flip(ddp.module.head.weight, 1, 20)
    return str(e.value)


# -- equal replicas never raise ----------------------------------------------------
def _equal_everywhere(rank, world_size):
    """Every way of training the wrapper offers, checked at every step: the check ran
    (passed) and never raised."""
    checked = {}
    for label, name, kwargs, accumulate, hook in [
            ("batchnorm", "batchnorm", {}, 1, None),
            ("batchnorm, no buffer sync", "batchnorm", {"forward_sync_buffers": False}, 1, None),
            ("no_sync accumulation", "deep", {}, 3, None),
            ("comm hook", "deep", {}, 1, default_hooks.allreduce_hook),
            ("find_unused_parameters", "branch", {"find_unused_parameters": True}, 1, None),
            ("static_graph", "tied", {"static_graph": True}, 1, None),
            ("bucket views, ring", "deep", {"gradient_as_bucket_view": True,
                                            "algorithm": "ring", "bucket_cap_mb": 0.001}, 1,
             None),
            ("fp16", "deep", {"compression": "fp16"}, 1, None)]:
        torch.manual_seed(0)
        ddp = minddp.DDP(MODELS[name](), check_replicas=1, **kwargs)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
        for step in range(6):
            opt.zero_grad()
            for micro in range(accumulate):
                inputs = batch(name, rank, 10 * step + micro)
                if micro < accumulate - 1:
                    with ddp.no_sync():
                        ddp(*inputs).square().mean().backward()
                else:
                    ddp(*inputs).square().mean().backward()
            opt.step()
        checked[label] = ddp.reducer.replicas.passed
    return checked


def test_equal_replicas_never_raise():
    for checked in run_world(_equal_everywhere, 2, timeout=120):
        assert checked == {label: 6 for label in checked}, checked


def _two_wrappers_and_join(rank, world_size):
    torch.manual_seed(0)
    first = minddp.DDP(MODELS["deep"](), check_replicas=1)
    second = minddp.DDP(MODELS["batchnorm"](), check_replicas=2)
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.05)
    for step in range(4):  # one loss through both wrappers: their checks share a FIFO
        opt.zero_grad()
        loss = first(*batch("deep", rank, step)).square().mean() + \
            second(*batch("batchnorm", rank, step)).square().mean()
        loss.backward()
        opt.step()
    with first.join():  # uneven inputs: a joined rank shadows the check
        for step in range(2 * (rank + 1)):
            opt.zero_grad()
            first(*batch("deep", rank, step)).square().mean().backward()
            opt.step()
    return first.reducer.replicas.passed, second.reducer.replicas.passed, \
        [p.detach().clone() for p in first.module.parameters()]


def test_two_wrappers_and_join_never_raise():
    results = run_world(_two_wrappers_and_join, 3, timeout=90)
    assert [r[:2] for r in results] == [(4 + 6, 3)] * 3  # 4 steps + the longest rank's 6
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r[2], results[0][2]))


def _default_on(rank, world_size):
    ddp = minddp.DDP(nn.Linear(4, 4))
    return ddp.check_replicas, ddp.reducer.replicas.interval


def test_on_by_default():
    assert run_world(_default_on, 2) == [(replicas.DEFAULT_INTERVAL,) * 2] * 2


def _local_sgd(rank, world_size, wrap):
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as local_sgd
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = wrap(model)
    # no gradient all-reduce from step 2 on: each rank's weights go their own way
    ddp.register_comm_hook(local_sgd.PostLocalSGDState(None, None, start_localSGD_iter=2,
                                                       post_local_gradient_allreduce=False),
                           local_sgd.post_localSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        g = torch.Generator().manual_seed(10 * rank + step)
        ddp(torch.randn(3, 4, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _local_sgd_both(rank, world_size):
    return (_local_sgd(rank, world_size, torch.nn.parallel.DistributedDataParallel),
            _local_sgd(rank, world_size,
                       lambda m: minddp.DDP(m, algorithm="native", check_replicas=1)))


def test_local_sgd_hook_turns_the_check_off():
    # replicas differ on purpose between averagings: torch's numbers, no ReplicasDiverged
    results = run_world(_local_sgd_both, 2, timeout=60)
    for theirs, ours in results:
        assert all(torch.equal(a, b) for a, b in zip(theirs, ours))
    assert not torch.equal(results[0][1][0], results[1][1][0])  # the ranks did part


def _embedding_with_max_norm(rank, world_size):
    """nn.Embedding(max_norm=...) renormalises, inside forward, the rows each rank looked up."""
    torch.manual_seed(0)
    ddp = minddp.DDP(torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=0.5),
                                         torch.nn.Linear(4, 1)), check_replicas=1)
    try:
        for step in range(3):
            ddp(torch.tensor([rank * 5 + step])).sum().backward()
    except replicas.ReplicasDiverged as e:
        return step, str(e)
    return None, "no error"


def test_an_embedding_with_max_norm_is_named_as_the_cause():
    step, message = _same_error_everywhere(run_world(_embedding_with_max_norm, 2))
    assert step == 0, message  # the first forward renormalised; the first check sees it
    for words in ("'0.weight'", "nn.Embedding", "max_norm", "renormalises", "check_replicas=0"):
        assert words in message, (words, message)


def _optimizer_in_a_gradient_hook(rank, world_size):
    """torch's tutorial pattern: an optimizer per parameter, stepped from its
    post-accumulate-grad hook, which sees this rank's gradient, not the average."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step(p):
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    ddp = minddp.DDP(model, check_replicas=1)
    try:
        for step in range(3):
            ddp(torch.full((2, 4), float(rank + step))).sum().backward()
    except replicas.ReplicasDiverged as e:
        return step, str(e)
    return None, "no error"


def test_an_optimizer_stepped_in_a_gradient_hook_is_named_as_the_cause():
    step, message = _same_error_everywhere(run_world(_optimizer_in_a_gradient_hook, 2))
    assert step == 0, message
    for words in ("has a hook that runs on this rank's gradient", "before the ranks' average",
                  "register_post_accumulate_grad_hook", "_apply_optimizer_in_backward before "
                  "the first forward", "check_replicas=0", "of 4 parameters differ: '0.weight'"):
        assert words in message, (words, message)
