"""copy.deepcopy, torch.save and torch.load of the wrapper, as torch's DDP does them.

torch drops the process group and the reducer when a DDP is pickled and
rebuilds them on load, on the default group; a copy must then train exactly
as torch's own copy does. A wrapper on another group refuses to pickle, with
torch's words.
"""
import copy
import io

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from dist_harness import run_world
from models import BatchNormNet, batch


def _train(ddp, rank, steps):
    for step in steps:
        ddp.zero_grad()
        ddp(*batch("batchnorm", rank, step)).square().mean().backward()
    return [p.grad.clone() for p in ddp.module.parameters()]


def _copies(rank, world_size, how):
    torch.manual_seed(0)
    model = BatchNormNet()
    results = []
    for wrap in (TorchDDP, minddp.DDP):
        ddp = wrap(copy.deepcopy(model))
        _train(ddp, rank, [0])
        if how == "deepcopy":
            again = copy.deepcopy(ddp)
        else:
            saved = io.BytesIO()
            torch.save(ddp, saved)
            saved.seek(0)
            again = torch.load(saved, weights_only=False)
        assert again.module is not ddp.module
        results.append(_train(again, rank, [1, 2]) + _train(ddp, rank, [3]))
    return all(torch.equal(a, b) for a, b in zip(*results))


def test_deepcopy_trains_as_torchs_copy():
    assert run_world(_copies, 2, "deepcopy") == [True, True]


def test_save_and_load_train_as_torchs():
    assert run_world(_copies, 2, "save") == [True, True]


def _from_an_older_pickle(rank, world_size):
    """A wrapper pickled before a setting existed loads with its default and trains."""
    ddp = minddp.DDP(torch.nn.Linear(4, 2), find_unused_parameters=True)
    state = ddp.__getstate__()
    del state["_ddp_sink_clone"]  # what minddp pickled before _set_ddp_sink_clone
    older = minddp.DDP.__new__(minddp.DDP)
    older.__setstate__(state)
    older(torch.full((3, 4), rank + 1.0)).sum().backward()
    return older.module.weight.grad


def test_a_wrapper_pickled_before_a_setting_existed_trains():
    for grad in run_world(_from_an_older_pickle, 2):
        assert torch.equal(grad, torch.full((2, 4), 4.5)), grad  # the mean of 3 and 6


def _other_group(rank, world_size):
    ddp = minddp.DDP(BatchNormNet(), process_group=dist.new_group([0, 1]))
    try:
        copy.deepcopy(ddp)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_pickling_on_another_group_is_refused():
    for error in run_world(_other_group, 2):
        assert "only supported when using DDP with the default process group" in error, error
