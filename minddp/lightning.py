"""Lightning strategy: `Trainer(strategy="minddp")` trains through minddp's wrapper.

    import minddp.lightning                                  # registers "minddp"
    trainer = Trainer(accelerator="cpu", devices=2, strategy="minddp")
    trainer = Trainer(devices=2, strategy=minddp.lightning.MinddpStrategy(
        algorithm="ring", compression="fp16", static_graph=True))

`MinddpStrategy` is Lightning's `DDPStrategy` with one change: the model is
wrapped in `minddp.DistributedDataParallel` instead of torch's. minddp's
wrapper is a subclass of torch's, so every other path of the stock strategy
(gradient accumulation through `no_sync`, manual optimisation's
`prepare_for_backward`, static graph, unwrapping at teardown) reaches minddp's
own methods. Two deliberate departures: comm hooks (`ddp_comm_hook=`) are
registered on every device (the stock strategy ignores them off CUDA; minddp
runs them on CPU too), and teardown removes the wrapper's gradient hooks, so
a later `fit` of the same module wraps it afresh.

Keywords: DDPStrategy's (torch DDP's keywords go to the wrapper, as there),
plus minddp's keyword-only ones (`algorithm`, `compression`, `timeline`, ...).
`timeout` keeps DDPStrategy's meaning, the process group's timeout; given
explicitly it also bounds minddp's waits for a peer (which by default follow
the group's).

This is the only minddp module that imports Lightning. It supports both
package names: `lightning.pytorch` (`MinddpStrategy`) and the older
`pytorch_lightning` (`MinddpStrategyPL`). Importing this module registers
"minddp" (and "minddp_spawn", "minddp_fork", "minddp_notebook", with those start
methods) with `lightning.pytorch`, and with `pytorch_lightning` too where that
is already imported or `lightning` is not installed; touching
`minddp.lightning.MinddpStrategyPL` registers it there in any case.
"""
import datetime
import importlib
import importlib.util
import sys
from contextlib import nullcontext

import torch

import minddp
from minddp.swap import MINDDP_KEYWORDS  # minddp's own keyword-only arguments

# Registered names and their start methods, as the stock strategy registers ddp*.
NAMES = (("minddp", "popen"), ("minddp_spawn", "spawn"), ("minddp_fork", "fork"),
         ("minddp_notebook", "fork"))
_CLASS_NAMES = {"lightning.pytorch": "MinddpStrategy", "pytorch_lightning": "MinddpStrategyPL"}


def strategy_class(package="lightning.pytorch"):
    """The strategy class for `package` ("lightning.pytorch" or "pytorch_lightning"),
    registered in that package's StrategyRegistry; built once per package."""
    name = _CLASS_NAMES[package]
    if name not in globals():
        globals()[name] = _build(package, name)
    return globals()[name]


def _build(package, class_name):
    strategies = importlib.import_module(f"{package}.strategies")
    overrides = importlib.import_module(f"{package}.overrides.distributed")

    class Strategy(strategies.DDPStrategy):
        def __init__(self, *args, **kwargs):
            self._minddp_kwargs = {k: kwargs.pop(k) for k in MINDDP_KEYWORDS
                                   if k in kwargs and k != "timeout"}
            timeout = kwargs.get("timeout")
            if isinstance(timeout, (int, float)):
                kwargs["timeout"] = timeout = datetime.timedelta(seconds=timeout)
            if timeout is not None:  # given explicitly: it bounds minddp's waits too
                self._minddp_kwargs["timeout"] = timeout
            super().__init__(*args, **kwargs)

        def _setup_model(self, model):
            device_ids = self.determine_ddp_device_ids()
            # As the stock strategy: build the wrapper on a side stream (torch's CUDA notes).
            ctx = (torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None
                   else nullcontext())
            with ctx:
                return minddp.DistributedDataParallel(module=model, device_ids=device_ids,
                                                      **self._ddp_kwargs, **self._minddp_kwargs)

        def _register_ddp_hooks(self):
            # The stock strategy registers hooks on CUDA only (torch's hooks once
            # needed NCCL); minddp reduces through a registered hook on any device.
            overrides._register_ddp_comm_hook(
                model=self.model, ddp_comm_state=self._ddp_comm_state,
                ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)

        def teardown(self):
            wrapper = self.model if isinstance(self.model, minddp.DistributedDataParallel) else None
            super().teardown()  # reads the wrapper's logging data, then unwraps
            if wrapper is not None:
                # Remove the gradient hooks now rather than whenever the wrapper is
                # collected: the next fit wraps the same parameters again.
                wrapper.close()

        @classmethod
        def register_strategies(cls, strategy_registry):
            for name, start_method in NAMES:
                strategy_registry.register(
                    name, cls, override=True, start_method=start_method,
                    description=f"minddp.DistributedDataParallel, start_method '{start_method}'")

    Strategy.__name__ = Strategy.__qualname__ = class_name
    Strategy.__doc__ = (f"{package}'s DDPStrategy with minddp.DistributedDataParallel as the "
                        f"wrapper; minddp's keywords besides DDPStrategy's (module docstring).")
    Strategy.__module__ = __name__
    Strategy.register_strategies(strategies.StrategyRegistry)
    return Strategy


def __getattr__(name):
    """MinddpStrategyPL is built (importing pytorch_lightning) on first use."""
    for package, class_name in _CLASS_NAMES.items():
        if name == class_name:
            return strategy_class(package)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _installed(package):
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:
        return False


if _installed("lightning.pytorch"):
    MinddpStrategy = strategy_class("lightning.pytorch")
if "pytorch_lightning" in sys.modules or not _installed("lightning.pytorch"):
    if not _installed("pytorch_lightning"):
        raise ImportError("minddp.lightning needs Lightning: pip install lightning")
    MinddpStrategyPL = strategy_class("pytorch_lightning")
