"""Code that constructs torch's DDP by name gets minddp's: replace_torch_ddp().

    import minddp
    minddp.replace_torch_ddp()                      # for the rest of the process
    with minddp.replace_torch_ddp(algorithm="ring"): # or for a block
        model = accelerator.prepare(model)

Accelerate (and the HF Trainer through it) builds its wrapper as
`torch.nn.parallel.DistributedDataParallel(model, ...)`, looked up when it is
called; that name is rebound. Others hold torch's class under a name of their
own, taken at import before or after the swap (Ray Train's prepare_model,
imported in its workers before the user's code runs; Lightning, from
`torch.nn.parallel.distributed`; torch's `replicate()`): while the swap is
active, constructing torch's class itself builds minddp's wrapper, whatever
name it is reached by (its `__new__` picks the class, and Python then runs that
class's `__init__`). Unpickling, which calls `__new__` with no arguments, still
makes torch's. A framework's own subclass of torch's DDP (its reducer is
torch's, and its methods may need it) is built as it is, with a warning. Every
minddp wrapper passes `isinstance(model, DistributedDataParallel)` against
torch's class, so the frameworks' checks take it; a check made through the
rebound name while the swap is in force answers as one against torch's class
(isinstance; not issubclass).
"""
import inspect
import warnings

import torch.nn.parallel

from minddp import ddp


class _AnsweringAsTorchs(type(ddp.DistributedDataParallel)):  # torch DDP is Joinable, an ABC
    """isinstance against the swap's class answers as against torch's class, whose
    name it takes: code that checks `isinstance(model,
    torch.nn.parallel.DistributedDataParallel)` while the swap is in force (Accelerate's
    unwrap_model) takes a minddp.DDP built directly, and a torch DDP, as without it.
    issubclass is left as it is: ABCMeta answers issubclass against a class by asking
    its subclasses, so widening this one would make torch's DDP pass for minddp's."""

    def __instancecheck__(cls, obj):
        return ddp.TorchDDP in type(obj).__mro__

    def __setattr__(cls, name, value):
        # Code that marks the DDP whose module runs (`DistributedDataParallel.
        # _active_ddp_module = self`, as torch's own FakeDDP test helper does) through the
        # rebound name must reach torch's class, where dynamo's DDPOptimizer reads it.
        type.__setattr__(ddp.TorchDDP if name == "_active_ddp_module" else cls, name, value)


class DistributedDataParallel(ddp.DistributedDataParallel, metaclass=_AnsweringAsTorchs):
    """minddp's wrapper with the keywords given to the active replace_torch_ddp()
    as defaults (a keyword passed at construction wins)."""

    keywords = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**type(self).keywords, **kwargs})


# minddp's own keywords (keyword-only in the wrapper's signature).
MINDDP_KEYWORDS = tuple(
    name for name, p in inspect.signature(ddp.DistributedDataParallel.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)


class replace_torch_ddp:
    """Rebind `torch.nn.parallel.DistributedDataParallel` to minddp's wrapper.

    `keywords` are minddp's own (algorithm=, compression=, ...), applied to
    every wrapper built through the name. A plain call lasts for the process;
    as a context manager, torch's class is back on exit. Call it on every rank.
    """

    def __init__(self, **keywords):
        unknown = sorted(set(keywords) - set(MINDDP_KEYWORDS))
        if unknown:
            raise TypeError(f"minddp.replace_torch_ddp: unknown keyword(s) {unknown}; minddp's "
                            f"own are {list(MINDDP_KEYWORDS)} (torch's keywords go to the "
                            f"framework, which passes them on).")
        self._previous = (torch.nn.parallel.DistributedDataParallel,
                          DistributedDataParallel.keywords)
        DistributedDataParallel.keywords = dict(keywords)
        torch.nn.parallel.DistributedDataParallel = DistributedDataParallel
        # Installed once and left: CPython cannot give a class whose __new__ was
        # deleted its constructor arguments back ("object.__new__() takes exactly one
        # argument"); outside a swap it makes what it is asked for.
        if ddp.TorchDDP.__dict__.get("__new__") is not _NEW:
            ddp.TorchDDP.__new__ = _NEW

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        torch.nn.parallel.DistributedDataParallel, DistributedDataParallel.keywords = \
            self._previous
        return False


_warned = set()


def _new(cls, *args, **kwargs):
    """torch's DDP class's __new__ while the swap is active: a construction of torch's
    class (it has arguments; unpickling has none) makes minddp's wrapper, with the
    swap's keywords."""
    active = torch.nn.parallel.DistributedDataParallel is DistributedDataParallel  # swapped
    constructed = active and bool(args or kwargs)
    if cls is ddp.TorchDDP and constructed:
        return object.__new__(DistributedDataParallel)
    if constructed and not issubclass(cls, ddp.DistributedDataParallel) and cls not in _warned:
        _warned.add(cls)
        warnings.warn(f"minddp.replace_torch_ddp(): {cls.__module__}.{cls.__qualname__} "
                      f"subclasses torch's DistributedDataParallel, so it is built as it is, "
                      f"with torch's reducer, not minddp's. To use minddp's, derive the class "
                      f"from minddp.DistributedDataParallel.", stacklevel=2)
    return object.__new__(cls)


_NEW = staticmethod(_new)
