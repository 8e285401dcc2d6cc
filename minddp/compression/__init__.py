"""Gradient compression: what `compression=` names, one registry with the algorithms.

    codecs.py     fp16, bf16 and int8 codecs on the extension's kernels, registered
                  with minddp.register_codec; ErrorFeedback for codecs that ask for it
    kernels.py    where the kernels come from (minddp._C, or reference.py)
    reference.py  the kernels' pure-torch reference
    auto.py       compression="auto": per bucket, fp16 or int8 where it pays
    powersgd.py   compression="powersgd" or PowerSGD(...): rank-r factors

A codec travels on every hop of a per-hop algorithm (ring, tree,
halving-doubling, shared memory, auto): partial sums stay fp32 and every rank
ends bitwise equal. The whole-bucket compressions (auto, PowerSGD) are Reductions of their
own (reduction.py), registered by name here.
"""
from minddp import algorithms, registry
from minddp.algorithms import collective
from minddp.compression import codecs  # noqa: F401  (registers fp16, bf16, int8)
from minddp.compression.auto import AutoCompression
from minddp.compression.codecs import DTYPES, ErrorFeedback, KernelCodec  # noqa: F401
from minddp.compression.kernels import HAVE_EXTENSION, kernels_for  # noqa: F401
from minddp.compression.powersgd import PowerSGD, PowerSGDReduction
from minddp.reduction import AlgorithmReduction


def _powersgd(engine, algorithm, group, name, timeline, world_size, settings=None):
    return PowerSGDReduction(engine, collective(algorithm, group), settings or PowerSGD(),
                             world_size, name, timeline)


def _auto(engine, algorithm, group, name, timeline, world_size):
    return AutoCompression(engine, algorithm, group, name, timeline)


registry.register_whole_bucket("powersgd", _powersgd)
registry.register_whole_bucket("auto", _auto)


def settings(compression):
    """What the wrapper keeps of `compression`: "powersgd" becomes PowerSGD(), so that
    ranks compare (and logs show) the settings themselves."""
    return PowerSGD() if registry.whole_bucket(compression) is _powersgd else compression


def check(compression, algorithm, rank):
    """Raise a ValueError naming the rank and the fix where `compression` is unknown or
    `algorithm` (a registered name) cannot carry it."""
    if compression is None or isinstance(compression, PowerSGD):
        return
    if registry.whole_bucket(compression) is not None:
        return
    try:
        codec = registry.codec(compression)
    except ValueError:
        raise ValueError(f"minddp (rank {rank}): unknown compression {compression!r}; choose "
                         f"one of {registry.compression_names()}, None or minddp.PowerSGD("
                         f"rank=..., warmup_steps=...), or register a codec "
                         f"(minddp.register_codec)") from None
    why = registry.algorithm(algorithm).carries(codec)
    if why is not None:
        raise ValueError(f"minddp (rank {rank}): algorithm {algorithm!r} cannot carry "
                         f"compression {compression!r}: {why}. Use one of "
                         f"{registry.algorithm_names(per_hop_only=True)}, which sum in fp32 "
                         f"at every hop, or another compression.")


def codec_collective(algorithm, group, codec):
    """The collective of `algorithm` with `codec` (a Codec or None), with error feedback where
    the codec asks for it."""
    run = collective(algorithm, group, codec)
    return ErrorFeedback(run, codec) if codec is not None and codec.error_feedback else run


def reduction(compression, engine, algorithm, group, name, timeline, world_size):
    """The Reduction (reduction.py) that sums buckets with `algorithm` and `compression`:
    None, a registered codec's name, a whole-bucket compression's name, or PowerSGD(...)."""
    if isinstance(compression, PowerSGD):
        return _powersgd(engine, algorithm, group, name, timeline, world_size, compression)
    factory = registry.whole_bucket(compression)
    if factory is not None:
        return factory(engine, algorithm, group, name, timeline, world_size)
    codec = None if compression is None else registry.codec(compression)
    return AlgorithmReduction(engine, codec_collective(algorithm, group, codec), name, timeline,
                              exact=codec is None)


def all_reduce(tensor, algorithm="ring", group=None, compression="fp16"):
    """minddp.all_reduce with a codec: in-place sum of `tensor` over `group`, each hop
    encoded by the registered codec `compression`.

    Every rank of the group calls it with a tensor of the same shape and
    dtype; returns the tensor, bitwise equal on every rank. Error feedback
    (a codec registered with it) needs state across calls, which this
    one-off sum has not: such a codec is applied without it here.
    """
    return algorithms.all_reduce(tensor, algorithm, group, registry.codec(compression))
