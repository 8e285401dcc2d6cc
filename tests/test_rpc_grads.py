"""DDP under torch.distributed.autograd (RPC): gradients are summed in the context.

torch's own suite for this (torch/testing/_internal/distributed/
ddp_under_dist_autograd_test.py, DdpComparisonTest) runs a step twice, once with
dist_autograd.backward and once with loss.backward(), and wants the same averaged
gradients in the context as in .grad. The same check, on 2 ranks, for a dense and
a sparse (EmbeddingBag) parameter, with torch's DDP as the control.
"""
import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

import minddp
from dist_harness import free_port, run_world

pytestmark = pytest.mark.skipif(not rpc.is_available(), reason="torch built without RPC")


def _local_vs_dist_autograd(rank, world_size, port, kind):
    import torch.distributed.autograd as dist_autograd
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     init_method=f"tcp://127.0.0.1:{port}"))
    try:
        torch.manual_seed(0)
        wrap = (torch.nn.parallel.DistributedDataParallel if kind == "torch"
                else lambda m: minddp.DDP(m, algorithm="native"))
        dense, sparse = nn.Linear(2, 3), nn.EmbeddingBag(10, 3, sparse=True)
        results = []
        for model, inputs in ((dense, (torch.rand(3, 2, generator=torch.Generator()
                                                   .manual_seed(rank)),)),
                              (sparse, (torch.tensor([rank, 2, 3, 9]), torch.tensor([0, 2])))):
            ddp = wrap(model)
            ddp(*inputs).sum().backward()
            local = [p.grad.to_dense().clone() for p in model.parameters()]
            with dist_autograd.context() as context_id:
                dist_autograd.backward(context_id, [ddp(*inputs).sum()])
                found = dist_autograd.get_gradients(context_id)
                in_context = [found[p].to_dense().clone() for p in model.parameters()]
            results.append((local, in_context))
            model.zero_grad()
            with dist_autograd.context():  # a local backward inside a context: .grad
                ddp(*inputs).sum().backward()
            results.append((local, [p.grad.to_dense().clone() for p in model.parameters()]))
        return results
    finally:
        rpc.shutdown()


@pytest.mark.parametrize("kind", ["torch", "minddp"])
def test_dist_autograd_context_gets_the_averaged_gradients(kind):
    for rank, results in enumerate(run_world(_local_vs_dist_autograd, 2, free_port(), kind,
                                             timeout=90)):
        for local, in_context in results:
            for a, b in zip(local, in_context):
                assert torch.equal(a, b), f"rank {rank}: {b} in the context, {a} in .grad"
