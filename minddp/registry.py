"""The one registry: every all-reduce algorithm and every codec minddp knows, by name.

The built-in ones register here through the same calls a researcher uses, so
nothing anywhere else compares names; the wrapper, `minddp.all_reduce`,
`algorithm="auto"`, the benchmarks and the shared test battery list what is
registered. This module imports nothing else of minddp: everything may
import it.

    @minddp.register_algorithm("mine")          # or register_algorithm("mine", fn, auto=False)
    def mine(tensor, group): ...                # in-place sum over group, every rank calls it
    minddp.register_codec("mine8", encode=enc, decode=dec, error_feedback=True)

A **collective** is what the rest of minddp calls to sum one tensor:
`collective(tensor) -> tensor, or a Future of it`, bound to a group (and a
codec) by `Algorithm.collective`. It is the one word for "something that
sums"; a Reduction (reduction.py) sums a whole gradient bucket with one.
"""
import dataclasses
import functools
import importlib.util
import os
import sys
from typing import Callable, Optional

import torch

_algorithms = {}  # name -> Algorithm, in registration order (auto's order on a tie)
_codecs = {}  # name -> Codec
_whole_bucket = {}  # name -> factory of a Reduction: compressions that are not codecs


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A registered all-reduce. Only `name` and `all_reduce` are required.

    all_reduce  all_reduce(tensor, group) sums `tensor` in place over `group`;
                every rank of the group calls it with a tensor of the same shape
                and dtype. With per_hop: all_reduce(tensor, group, codec=None,
                error=None), routing every hop through the codec (p2p.py's link;
                shared_memory.py's slices)
    auto        whether algorithm="auto" times it among its candidates
    cost        cost(nbytes, p, costs) -> predicted seconds (cost_model.Costs);
                without one, auto times the algorithm on every bucket size
    per_hop     it encodes every hop with a codec and keeps partial sums in
                fp32: any codec rides on it, with error feedback
    launch      launch(tensor, group) -> Future: an asynchronous form, which
                the communication engine may start from the training thread
    runs_on     runs_on(group) -> bool: whether the group's backend can run it
    bind        bind(group, codec) -> collective: a stateful form (auto's)
    allocate    allocate(numel, dtype, device, group) -> zeros or None: storage for a
                bucket it sums in place better than a copy of it (shared memory);
                local, called on every rank before `setup`
    setup       setup(buffers, group): every rank together, with the buckets it will
                sum, before the first (the buffers `allocate` made get linked)
    """
    name: str
    all_reduce: Callable
    auto: bool = True
    cost: Optional[Callable] = None
    per_hop: bool = False
    launch: Optional[Callable] = None
    runs_on: Optional[Callable] = None
    bind: Optional[Callable] = None
    allocate: Optional[Callable] = None
    setup: Optional[Callable] = None

    def can_run(self, group):
        return self.runs_on is None or self.runs_on(group)

    def carries(self, codec):
        """Why this algorithm cannot sum with `codec`, or None when it can."""
        if codec is None or self.per_hop:
            return None
        if codec.error_feedback:
            return (f"{codec.name}'s error feedback records what each hop's encoding changed, "
                    f"and {self.name!r} does not send its hops through a codec")
        if codec.sum_whole is None:
            return (f"{self.name!r} does not send its hops through a codec, and {codec.name} "
                    f"values cannot be added as they travel")
        return None

    def collective(self, group, codec=None):
        """`collective(tensor) -> tensor or Future`: this algorithm summing over `group`.

        `codec` (a registered Codec) goes on every hop of a per-hop algorithm;
        one that is not sums the codec's encoding whole where the codec allows
        (fp16/bf16: Codec.sum_whole). A ValueError says when neither can be.
        """
        if self.bind is not None:
            return self.bind(group, codec)
        if codec is None:
            if self.launch is None:
                run = _in_place(self.all_reduce, group)
            else:
                run = functools.partial(self.launch, group=group)
                run.nonblocking = True  # comm.py may start it from the training thread
            if self.allocate is not None:
                run.allocate = functools.partial(self.allocate, group=group)
            if self.setup is not None:
                run.setup = lambda buffers, provisional=False: self.setup(buffers, group)
            return run
        why = self.carries(codec)
        if why is not None:
            raise ValueError(f"minddp: algorithm {self.name!r} cannot carry compression "
                             f"{codec.name!r}: {why}. Use a per-hop algorithm "
                             f"({', '.join(per_hop_names())}) or another compression.")
        if self.per_hop:
            return functools.partial(self.all_reduce, group=group, codec=codec)
        return functools.partial(codec.sum_whole, group=group,
                                 all_reduce=_in_place(self.all_reduce, group))


def _in_place(fn, group):
    """`fn(tensor, group)` as a collective that returns the tensor, also where `fn` only
    sums in place and returns None (register_algorithm asks no more)."""
    def collective(tensor):
        result = fn(tensor, group)
        return tensor if result is None else result
    return collective


class Codec:
    """How a float32 chunk travels: `encode(chunk) -> tuple of tensors` and
    `decode(wire) -> float32 tensor` (register_codec's two functions).

    The wire's sizes must depend only on the chunk's size (receivers allocate
    them before the data arrives). Non-float32 chunks travel as themselves.
    Subclasses may fuse the steps (minddp's kernels do): decode_add_,
    decode_, encode_into, encode_with_feedback and wire_itemsize are what the
    algorithms call. `sum_whole(tensor, group, all_reduce)`, where set, sums an encoding
    with a plain algorithm (values that can be added as they are).
    """

    sum_whole = None

    def __init__(self, encode=None, decode=None, error_feedback=False):
        self._encode, self._decode = encode, decode
        self.error_feedback = error_feedback
        self.name = getattr(self, "name", None)
        self._itemsize = None

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r})"

    def compresses(self, tensor):
        return tensor.dtype == torch.float32

    def encode(self, chunk):
        """The tensors to send for `chunk`: its encoding, or [chunk] if it is not float32.
        Each goes out contiguous and on the chunk's device, as send and recv need."""
        if not self.compresses(chunk):
            return [chunk]
        wire = self._encode(chunk.contiguous())
        if not isinstance(wire, (tuple, list)) or not all(isinstance(w, torch.Tensor)
                                                          for w in wire):
            raise TypeError(f"codec {self.name!r}: encode must return a tuple of tensors, got "
                            f"{type(wire).__name__}; e.g. `return (values, scale)`")
        return [w.to(chunk.device).contiguous() for w in wire]

    def encode_into(self, chunk, slots):
        """encode(chunk), written into `slots` (tensors with the wire's shapes and dtypes,
        e.g. a slot in a shared file); returns them."""
        for slot, w in zip(slots, self.encode(chunk)):
            slot.copy_(w.view_as(slot))
        return slots

    def decoded(self, wire, like):
        """The wire decoded as a tensor shaped like `like`."""
        out = self._decode(tuple(wire))
        if out.numel() != like.numel():
            raise ValueError(f"codec {self.name!r}: decode returned {out.numel()} elements for "
                             f"a chunk of {like.numel()}; it must return as many as encode took")
        return out.reshape_as(like)

    def decode_add_(self, dst, wire):
        """dst += the decoded wire, summed in dst's dtype (fp32 for compressed chunks)."""
        if not self.compresses(dst):
            return dst.add_(wire[0].view_as(dst))
        return dst.add_(self.decoded(wire, dst))

    def decode_(self, dst, wire):
        """dst = the decoded wire."""
        if not self.compresses(dst):
            return dst.copy_(wire[0].view_as(dst))
        return dst.copy_(self.decoded(wire, dst))

    def encode_with_feedback(self, chunk, error, decode=False):
        """encode(chunk - error), then error = what that encoding changed (decoded minus
        encoded; 0 where that is not finite). With `decode`, chunk becomes the decoding."""
        target = chunk - error.view_as(chunk)
        wire = self.encode(target)
        decoded = self.decoded(wire, target)
        change = decoded - target
        error.view_as(chunk).copy_(torch.where(torch.isfinite(change), change, 0.0))
        if decode:
            chunk.copy_(decoded)
        return wire

    def wire_itemsize(self, dtype, device="cpu"):
        """Bytes on the wire per element of a tensor of `dtype` on `device` (where an
        encoding is tried: a codec may run on one kind of device only)."""
        if dtype != torch.float32:
            return dtype.itemsize
        if self._itemsize is None:  # sizes depend on the size only: measure once
            n = 1 << 16
            wire = self.encode(torch.zeros(n, device=device))
            self._itemsize = sum(w.nbytes for w in wire) / n
        return self._itemsize


def register_algorithm(name, fn=None, auto=True, **richer):
    """Register `fn(tensor, group)`, an in-place sum over `group`, as algorithm `name`.

    Then DistributedDataParallel(algorithm=name), minddp.all_reduce(t,
    algorithm=name), algorithm="auto" (unless auto=False), the benchmarks and
    the shared tests all know it. Every rank must register the same
    algorithms. As a decorator: `@register_algorithm("mine")`. Keywords of
    the richer forms (cost, per_hop, launch, runs_on, bind, allocate, setup) are
    Algorithm's.
    Returns fn.
    """
    if fn is None:
        return lambda f: register_algorithm(name, f, auto, **richer)
    _check_name(name, "algorithm", _algorithms)
    if not callable(fn):
        raise TypeError(f"minddp.register_algorithm({name!r}): fn must be callable "
                        f"fn(tensor, group), got {type(fn).__name__}")
    _algorithms[name] = Algorithm(name, fn, auto, **richer)
    return fn


def register_codec(name, encode=None, decode=None, error_feedback=False, *, codec=None):
    """Register a codec under `name`: compression=name in the wrapper and in minddp.all_reduce.

    encode(float32 tensor) -> tuple of tensors whose sizes depend only on the
    input's size; decode(that tuple) -> float32 tensor of the input's size.
    It rides on every hop of minddp's per-hop algorithms (partial sums in
    fp32, every rank's result bitwise equal); error_feedback=True keeps, per
    bucket, what each encoding changed and sends it with the next sum. Or
    `codec=`: a Codec instance (fused kernels; minddp's own codecs).
    """
    if codec is None:
        if not (callable(encode) and callable(decode)):
            raise TypeError(f"minddp.register_codec({name!r}): give encode and decode "
                            f"functions (or codec=, a minddp.registry.Codec)")
        codec = Codec(encode, decode, error_feedback)
    elif encode is not None or decode is not None:
        raise TypeError(f"minddp.register_codec({name!r}): give encode and decode, or codec=, "
                        f"not both")
    _check_name(name, "codec", _codecs)
    if name in _whole_bucket:
        raise ValueError(f"minddp.register_codec: {name!r} is a compression already "
                         f"(whole-bucket); choose another name")
    codec.name = name
    _codecs[name] = codec
    return codec


def register_whole_bucket(name, factory):
    """A compression that is not a codec (PowerSGD, compression auto): `factory(engine,
    algorithm, group, name, timeline, world_size) -> Reduction` (reduction.py)."""
    _check_name(name, "compression", _whole_bucket)
    _whole_bucket[name] = factory


def _check_name(name, kind, table):
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"minddp: a {kind} name must be a Python identifier (it names "
                         f"benchmark rows), got {name!r}")
    if name in table:
        raise ValueError(f"minddp: {kind} {name!r} is registered already; choose another "
                         f"name")


def algorithm(name):
    """The Algorithm registered as `name`; a ValueError lists the choices otherwise."""
    try:
        return _algorithms[name]
    except (KeyError, TypeError):
        raise ValueError(f"minddp: unknown algorithm {name!r}; choose one of "
                         f"{algorithm_names()} or register it (minddp.register_algorithm)"
                         ) from None


def codec(name):
    """The Codec registered as `name`; a ValueError lists the choices otherwise."""
    try:
        return _codecs[name]
    except (KeyError, TypeError):
        raise ValueError(f"minddp: unknown codec {name!r}; choose one of {codec_names()} "
                         f"or register one (minddp.register_codec)") from None


def whole_bucket(name):
    """The Reduction factory of a whole-bucket compression, or None."""
    return _whole_bucket.get(name) if isinstance(name, str) else None


def algorithm_names(auto_only=False, per_hop_only=False):
    """Registered algorithm names, in registration order."""
    return [n for n, a in _algorithms.items()
            if (a.auto or not auto_only) and (a.per_hop or not per_hop_only)]


def per_hop_names():
    return [n for n, a in _algorithms.items() if a.per_hop and a.bind is None]


def codec_names():
    return list(_codecs)


def compression_names():
    return codec_names() + list(_whole_bucket)


def wait_sum(collective, tensor):
    """Run `collective` on `tensor` and wait for it (where the next step needs the sum:
    PowerSGD's factors, timing). Sums in place; returns `tensor`."""
    result = collective(tensor)
    if isinstance(result, torch._C.Future):  # the base of torch.futures.Future
        result = result.wait()
    if isinstance(result, (list, tuple)):
        result = result[0]
    if result is not tensor:
        tensor.copy_(result)
    return tensor


_loaded = {}  # resolved path -> module


def load(path):
    """Import a Python file (its registrations) once per process: benchmarks' and the
    test battery's --plugin. Every rank must load the same files."""
    path = os.path.realpath(path)
    if path not in _loaded:
        name = "minddp_plugin_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None:
            raise ValueError(f"minddp: cannot import {path!r} (not a Python file?)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        _loaded[path] = module
    return _loaded[path]
