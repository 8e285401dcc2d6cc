"""Code that constructs torch's DDP by name gets minddp's: replace_torch_ddp().

    import minddp
    minddp.replace_torch_ddp()                      # for the rest of the process
    with minddp.replace_torch_ddp(algorithm="ring"): # or for a block
        model = accelerator.prepare(model)

Accelerate (and the HF Trainer through it) builds its wrapper as
`torch.nn.parallel.DistributedDataParallel(model, ...)`, looked up when it is
called, so rebinding that one name is enough. Others took the name at import
(`from torch.nn.parallel import DistributedDataParallel`: Ray Train's
prepare_model, and Ray imports it in its workers before the user's code runs):
every module already imported that holds torch's class under any name is
rebound too (a script's own alias of torch's class included: keep torch's
class as `torch.nn.parallel.distributed.DistributedDataParallel` to build
torch's DDP meanwhile), and put back on exit. torch's own modules keep its class: its
internals (dynamo, the join hook) refer to it there. Every
minddp wrapper passes `isinstance(model, DistributedDataParallel)` against
torch's class; while the name is rebound, the check through the name holds
for the wrappers built through it (the class below), which is what the
frameworks that build through it then test.
"""
import inspect
import sys

import torch.nn.parallel

from minddp import ddp


class DistributedDataParallel(ddp.DistributedDataParallel):
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
        self._rebound = _holders(ddp.TorchDDP)  # found first: nothing is half-rebound
        self._previous = (torch.nn.parallel.DistributedDataParallel,
                          DistributedDataParallel.keywords)
        DistributedDataParallel.keywords = dict(keywords)
        torch.nn.parallel.DistributedDataParallel = DistributedDataParallel
        for module, name in self._rebound:
            setattr(module, name, DistributedDataParallel)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        torch.nn.parallel.DistributedDataParallel, DistributedDataParallel.keywords = \
            self._previous
        for module, name in self._rebound:
            if getattr(module, name, None) is DistributedDataParallel:
                setattr(module, name, ddp.TorchDDP)
        return False


def _holders(cls):
    """(module, name) of every imported module outside torch and minddp that holds
    `cls` as a global, whatever it is called there."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] in ("torch", "minddp"):
            continue
        try:  # the plain __dict__: a lazily loaded module must not load (or fail) here
            namespace = object.__getattribute__(module, "__dict__")
            names = [name for name, value in list(namespace.items()) if value is cls]
        except Exception:  # noqa: BLE001 - no plain namespace: nothing to rebind there
            continue
        found.extend((module, name) for name in names)
    return found
