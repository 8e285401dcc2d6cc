"""Ranks that are threads of one process (torch's threaded process group, the harness
of torch's MultiThreadedTestCase): the wrapper trains as torch's DDP there, over the
world and over subgroups, in one world after another.

The worlds run in a child process (this file as a script): installing the threaded
process group changes torch.distributed for the whole process."""
import json
import subprocess
import sys
import threading

import torch

WORLD = 4
ROUNDS = 2


def _step(wrapper, rank, group):
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    with torch.no_grad():  # not from torch's generator, which the threads share
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape) * (i + 1 + rank))
    ddp = wrapper(model, process_group=group)
    x = torch.arange(12.0).reshape(2, 6) * (rank + 1)
    ddp(x).square().sum().backward()
    return [p.grad for p in ddp.module.parameters()]


def _rank(rank, store, results):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import minddp

    try:
        dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
        differ = []
        for name, group in [("world", None), ("half", halves[rank // 2])]:
            ours, torchs = _step(minddp.DDP, rank, group), _step(TorchDDP, rank, group)
            differ += [name for a, b in zip(ours, torchs) if not torch.equal(a, b)]
        dist.destroy_process_group()
        results[rank] = "differs: " + ", ".join(differ) if differ else "ok"
    except Exception as e:  # noqa: BLE001 - reported to the test
        results[rank] = f"{type(e).__name__}: {e}"


def main():
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # as torch's harness does
    rounds = []
    for _ in range(ROUNDS):
        multi_threaded_pg._install_threaded_pg()
        store, results = dist.HashStore(), {}
        threads = [threading.Thread(target=_rank, args=(r, store, results), daemon=True)
                   for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        multi_threaded_pg._uninstall_threaded_pg()
        rounds.append([results.get(r, "still running after 60 s") for r in range(WORLD)])
    print(json.dumps(rounds), flush=True)


def test_ranks_as_threads_train_as_torchs_ddp_world_after_world():
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = json.loads(out.stdout.strip().splitlines()[-1])
    assert rounds == [["ok"] * WORLD] * ROUNDS, rounds


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    import os
    os._exit(0)  # threads a failed rank left behind must not keep the process alive
