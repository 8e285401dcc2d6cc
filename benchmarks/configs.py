"""The configurations compare.py puts side by side, each a wrapped copy of one model.

A configuration that this build of minddp cannot run (an algorithm or a
compression that has not landed) is reported as absent, with the reason,
instead of failing the benchmark.
"""
import copy
import dataclasses
import inspect
import os
import tempfile
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minddp
from minddp import buckets, registry
from minddp.grad_bucket import GradBucket

# name -> how to build it: ("bare",), ("torch", hook) or ("minddp", algorithm, compression),
# the last optionally followed by more keywords for minddp.DDP
CONFIGS = {
    "no_comm": ("bare",),
    "torch_ddp": ("torch", None),
    "torch_ddp_fp16": ("torch", default_hooks.fp16_compress_hook),
    "minddp_native": ("minddp", "native", None),
    "minddp_ring": ("minddp", "ring", None),
    "minddp_tree": ("minddp", "tree", None),
    "minddp_auto": ("minddp", "auto", None),
    "minddp_ring_fp16": ("minddp", "ring", "fp16"),
}
CONFIG_NAMES = list(CONFIGS)  # the default rows
# Opt-in rows (--configs): low-rank compression, PowerSGD's rank 4 after 10 full steps on both
# sides. torch's hook runs several asynchronous all-reduces per bucket while other buckets'
# run too, which gloo can pair across buckets ("Received data size doesn't match").
POWERSGD = minddp.PowerSGD(rank=4, warmup_steps=10)
CONFIGS.update({
    "torch_ddp_powersgd": ("torch", "powersgd"),
    "minddp_ring_powersgd": ("minddp", "ring", POWERSGD),
    "minddp_auto_powersgd": ("minddp", "auto", POWERSGD),
    "minddp_auto_powersgd_r16": ("minddp", "auto", minddp.PowerSGD(rank=16, warmup_steps=10)),
    # fp16 or int8 per bucket where it is timed faster and its error is within budget
    "minddp_auto_fp16": ("minddp", "auto", "fp16"),
    "minddp_compression_auto": ("minddp", "auto", "auto"),
    "minddp_ring_int8": ("minddp", "ring", "int8"),
    "minddp_auto_int8": ("minddp", "auto", "int8"),
    # what the replica check costs: minddp_native checks at the default interval
    # (minddp/replicas.py), these every synced step and never
    "minddp_native_replicas": ("minddp", "native", None, {"check_replicas": 1}),
    "minddp_native_noreplicas": ("minddp", "native", None, {"check_replicas": 0}),
    # torch's opt-in batched copies (one _foreach_copy_ and one div_ per bucket)
    "torch_ddp_batched": ("torch", None, {"batched_grad_copy": True}),
    # what recording a timeline (for python -m minddp.diagnose) costs: minddp_native with one,
    # written to the temporary folder at exit
    "minddp_native_timeline": ("minddp", "native", None,
                               {"timeline": os.path.join(tempfile.gettempdir(), "minddp-trace")}),
    # and ring with one: every message of every hop is noted too (hops.py, the link report)
    "minddp_ring_timeline": ("minddp", "ring", None, {
        "timeline": os.path.join(tempfile.gettempdir(), "minddp-trace-ring")}),
})


def split_name(name):
    """'torch_ddp@2' -> ('torch_ddp', 2.0); 'minddp_auto@auto' -> ('minddp_auto', 'auto');
    a plain name -> (name, None): the row takes --bucket-cap-mb."""
    base, _, cap = name.partition("@")
    if not cap:
        return base, None
    if cap == "auto":
        return base, cap
    try:
        value = float(cap)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise SystemExit(f"configuration {name!r}: the part after '@' must be a bucket cap in "
                         f"MiB (a positive number) or 'auto'")
    return base, value


def registered(name):
    """minddp_<algorithm> or minddp_<algorithm>_<compression>, any registered names
    (registry.py: plugins too), as a CONFIGS entry; None if the name is not one."""
    if not name.startswith("minddp_"):
        return None
    rest = name[len("minddp_"):]
    for algorithm in registry.algorithm_names():
        if rest == algorithm:
            return ("minddp", algorithm, None)
        codec = rest[len(algorithm) + 1:]
        if rest.startswith(algorithm + "_") and codec in registry.compression_names():
            return ("minddp", algorithm, codec)
    return None


def how_to_build(name):
    """The CONFIGS entry of a row name (without its @cap), named or registered."""
    return CONFIGS.get(name) or registered(name)


def load_plugins(paths):
    """Import each file (--plugin: its registrations, registry.load) on this rank; return the
    rows the new entries add to the defaults: minddp_<algorithm> for each new algorithm,
    minddp_<first per-hop algorithm>_<codec> for each new codec."""
    algorithms, codecs = set(registry.algorithm_names()), set(registry.codec_names())
    for path in paths:
        registry.load(path)
    carrier = registry.algorithm_names(per_hop_only=True)[0]
    return ([f"minddp_{a}" for a in registry.algorithm_names() if a not in algorithms] +
            [f"minddp_{carrier}_{c}" for c in registry.codec_names() if c not in codecs])


def check_names(names):
    """Exit with the list of known rows if a name is not one of them."""
    unknown = [n for n in names if how_to_build(split_name(n)[0]) is None]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; choose from {list(CONFIGS)} or "
                         f"minddp_<algorithm>[_<compression>] of the registered ones "
                         f"({registry.algorithm_names()}; {registry.compression_names()}), each "
                         f"optionally with @<bucket cap in MiB> or (minddp rows) @auto")


def wire_ratio(compression):
    """Bytes sent per byte summed (float32) with a registered codec, or full precision."""
    if compression is None:
        return 1.0
    return registry.codec(compression).wire_itemsize(torch.float32) / 4


@dataclasses.dataclass
class Config:
    name: str
    model: Optional[torch.nn.Module] = None
    optimizer: Optional[torch.optim.Optimizer] = None
    communicate: Optional[Callable[[], None]] = None  # the step's bucket reductions alone
    bytes_sent: Optional[float] = 0.0                  # per rank per step (estimate)
    sent_now: Optional[Callable[[], float]] = None     # bytes_sent, asked at the end of a run
    absent: Optional[str] = None                       # why this build cannot run it

    def sent_mb(self):
        """MiB sent per rank per step (an estimate), None where not known."""
        sent = self.sent_now() if self.sent_now is not None else self.bytes_sent
        return None if sent is None else sent / 2**20


def bytes_sent_per_rank(bucket_bytes, world_size, wire_ratio=1.0):
    """Ring-style all-reduce sends 2(p-1)/p of each bucket per rank."""
    return sum(bucket_bytes) * wire_ratio * 2 * (world_size - 1) / world_size


def _bucket_bytes(model, cap_mb):
    params = [p for p in model.parameters() if p.requires_grad]
    layout = buckets.assign(params, buckets.caps(int(cap_mb * 2**20)))
    return [sum(params[i].numel() * params[i].element_size() for i in b) for b in layout]


def _torch_communicate(bucket_bytes, device, hook):
    """What torch DDP's reduction costs alone: the same bucket sizes, the backend's
    all-reduce, cast to fp16 and back as fp16_compress_hook does."""
    flats = [torch.zeros(n // 4, device=device) for n in bucket_bytes]
    world = dist.get_world_size()

    def communicate():
        works = []
        for flat in flats:
            wire = flat.to(torch.float16).div_(world) if hook is not None else flat
            works.append((dist.all_reduce(wire, async_op=True), flat, wire))
        for work, flat, wire in works:
            work.wait()
            if wire is not flat:
                flat.copy_(wire)
    return communicate


def _minddp_communicate(ddp):
    """What minddp's reduction costs alone: every bucket's current contents through
    the wrapper's own seam (reducer.reduction), in order, waited for; .grad untouched."""
    reducer = ddp.reducer

    def communicate():
        last = len(reducer.buckets) - 1
        futures = [reducer.reduction.launch(GradBucket(bucket, bucket.index == last))
                   for bucket in reducer.buckets]
        for future in futures:
            future.wait()
    return communicate


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


def _powersgd_bytes(ddp, world_size):
    """Per rank per step once compression runs: P, Q and the uncompressed rest of each bucket."""
    sizes = []
    for bucket in ddp.reducer.buckets:
        s = ddp.reducer.reduction.states[bucket.index]
        numbers = s.p.numel() + s.q.numel() + s.rest.numel() if s.matrices else \
            bucket.buffer.numel()
        sizes.append(numbers * bucket.buffer.element_size())
    return bytes_sent_per_rank(sizes, world_size)


def build_configs(workload, names, device, cap_mb, timeline=None, as_view=False, optimizer=None):
    """One Config per name, each with its own copy of the workload's model (seed 0).
    With `timeline` (a path prefix) every minddp row records a Chrome trace;
    `as_view` is gradient_as_bucket_view for torch's rows and minddp's alike;
    `optimizer(params)` makes each row's optimizer (default: SGD, lr 1e-3)."""
    torch.manual_seed(0)
    base = workload.build().to(device)
    world = dist.get_world_size()
    device_ids = [device] if device.type == "cuda" else None
    configs = []
    for name in names:
        base_name, cap = split_name(name)
        cap = cap_mb if cap is None else cap
        kind, *how = how_to_build(base_name)
        if cap == "auto" and kind != "minddp":
            raise SystemExit(f"configuration {name!r}: only minddp rows take @auto")
        sizes = _bucket_bytes(base, 25 if cap == "auto" else cap)  # same total either way
        model = copy.deepcopy(base)
        config = Config(name)
        if kind == "bare":
            config.model = model
        elif kind == "torch":
            extra = how[1] if len(how) > 1 else {}
            missing = [k for k in extra if k not in inspect.signature(TorchDDP).parameters]
            if missing:  # batched_grad_copy: a keyword newer torch versions have
                config.absent = f"torch {torch.__version__}'s DDP has no {', '.join(missing)}"
                configs.append(config)
                continue
            config.model = TorchDDP(model, device_ids=device_ids, bucket_cap_mb=cap,
                                    gradient_as_bucket_view=as_view, **extra)
            if how[0] == "powersgd":
                state = powerSGD_hook.PowerSGDState(
                    process_group=None, matrix_approximation_rank=POWERSGD.rank,
                    start_powerSGD_iter=POWERSGD.warmup_steps, random_seed=POWERSGD.seed)
                config.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
                config.bytes_sent = None  # depends on torch's own choices per matrix
            else:
                if how[0] is not None:
                    config.model.register_comm_hook(None, how[0])
                config.communicate = _torch_communicate(sizes, device, how[0])
                config.bytes_sent = bytes_sent_per_rank(sizes, world, 0.5 if how[0] else 1.0)
        else:
            algorithm, compression, *more = how
            try:
                trace = f"{timeline}.{workload.name}.{name}" if timeline else None
                keywords = {"timeline": trace, **(more[0] if more else {})}
                config.model = minddp.DDP(model, device_ids=device_ids, bucket_cap_mb=cap,
                                          gradient_as_bucket_view=as_view,
                                          algorithm=algorithm, compression=compression,
                                          **keywords)
            except NotImplementedError:
                config.absent = f"{algorithm}/{compression or 'fp32'}: not implemented"
                configs.append(config)
                continue
            if isinstance(compression, minddp.PowerSGD):
                # Reducing outside a step would move PowerSGD's state (error, Q): no comm ms.
                config.bytes_sent = _powersgd_bytes(config.model, world)
            elif compression == "auto":
                config.communicate = _minddp_communicate(config.model)
                # as each bucket decided, which with bucket_cap_mb="auto" is at the plan
                config.sent_now = lambda reducer=config.model.reducer: bytes_sent_per_rank(
                    [b.nbytes * wire_ratio(reducer.reduction.compressed[b.index])
                     for b in reducer.buckets], world)
            else:
                config.communicate = _minddp_communicate(config.model)
                config.bytes_sent = bytes_sent_per_rank(sizes, world, wire_ratio(compression))
        config.optimizer = (optimizer or _sgd)(config.model.parameters())
        configs.append(config)
    return configs
