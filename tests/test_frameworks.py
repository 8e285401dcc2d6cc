"""minddp where DDP's users train: Lightning, Accelerate, the HF Trainer.

Each test launches two CPU ranks the way a user would (torchrun, `accelerate
launch`), runs a script from tests/frameworks/ that trains the same tiny model
with the framework's stock DDP and then with minddp (same seeds and data, in
the same world), and compares what each rank saved: parameters, buffers and
losses equal the stock run (relative 1e-6; at two ranks they come out bitwise
equal) and parameters are equal on both ranks. Nothing is downloaded.
"""
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "frameworks"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def needs(*packages):
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {' and '.join(missing)} "
                              f"(tools/make_venv.sh installs it on the CPU path, not on the "
                              f"offline GPU machine)")


def launch(command, out, timeout):
    """Run a launcher of two ranks; its output is the failure message (a failing
    rank's traceback, or where a hung world stood when it was killed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT),
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(command + [str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks: their own session
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(command)} hung (killed after {timeout}s):\n{output[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed (exit {proc.returncode}):\n{output[-12000:]}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_close(ours, stock, what):
    assert ours.keys() == stock.keys(), what
    for name in stock:
        torch.testing.assert_close(ours[name], stock[name], rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{what}, {name}: {m}")


def assert_equal_on_ranks(per_rank, what):
    for name, tensor in per_rank[0].items():
        assert torch.equal(tensor, per_rank[1][name]), f"{what}: {name} differs between ranks"


@needs("lightning")
def test_lightning_strategy_matches_ddp(tmp_path):
    """Trainer(strategy="minddp") against strategy="ddp", each rank: automatic optimisation
    with accumulate_grad_batches=2, a second fit of the same module, resuming from a
    checkpoint, manual optimisation (plain and static_graph), a comm hook; the model has
    BatchNorm. BatchNorm's running statistics are rank-local under torch's DDP too (rank 0's
    are broadcast before each forward, then each rank's forward updates its own), so buffers
    are compared with the stock run's on the same rank only."""
    ranks = launch(TORCHRUN + [str(SCRIPTS / "lightning_run.py")], tmp_path, timeout=240)
    for rank, result in enumerate(ranks):
        stock, ours = result["stock"], result["minddp"]
        assert ours.keys() == stock.keys()
        for scenario in stock:
            what = f"rank {rank}, {scenario}"
            assert ours[scenario]["wrappers"] == ["MinddpStrategy/minddp.ddp"], what
            assert stock[scenario]["wrappers"] == ["DDPStrategy/torch.nn.parallel.distributed"]
            assert ours[scenario]["unwrapped"], f"{what}: strategy.model is not the module"
            assert_close(ours[scenario]["params"], stock[scenario]["params"], what)
            assert_close(ours[scenario]["buffers"], stock[scenario]["buffers"], what)
            torch.testing.assert_close(ours[scenario]["losses"], stock[scenario]["losses"],
                                       rtol=1e-6, atol=1e-7)
        # minddp's strategy runs a registered hook on CPU; the stock one ignores it there.
        assert ours["comm_hook"]["hook_calls"] > 0 and stock["comm_hook"]["hook_calls"] == 0
    for scenario in ranks[0]["minddp"]:
        assert_equal_on_ranks([r["minddp"][scenario]["params"] for r in ranks], scenario)


ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]


@needs("accelerate")
def test_accelerate_with_the_one_line_matches_stock(tmp_path):
    """`accelerate launch` (its torchrun path; the script's Accelerator(cpu=True) makes it
    a multi-CPU gloo world), then minddp.replace_torch_ddp(): accumulate with the fp16 comm
    hook from DistributedDataParallelKwargs, clip_grad_norm_, unwrap_model,
    save_state/load_state, no_sync + trigger_sync_in_backward."""
    ranks = launch(ACCELERATE + [str(SCRIPTS / "accelerate_run.py")], tmp_path, timeout=240)
    for rank, result in enumerate(ranks):
        stock, ours = result["stock"], result["minddp"]
        assert ours["wrapper"] == "minddp.swap.DistributedDataParallel", ours["wrapper"]
        assert stock["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel"
        for run in (stock, ours):
            assert run["unwrapped_is_bare"], "unwrap_model did not return the bare model"
            assert run["load_state_restores"], "load_state did not restore the parameters"
        for scenario in ("accumulate", "resumed", "trigger_sync"):
            assert_close(ours[scenario]["params"], stock[scenario]["params"],
                         f"rank {rank}, {scenario}")
        assert_close(ours["accumulate"]["buffers"], stock["accumulate"]["buffers"], "buffers")
        for key in ("losses", "norms"):
            torch.testing.assert_close(ours["accumulate"][key], stock["accumulate"][key],
                                       rtol=1e-6, atol=1e-7)
    for scenario in ("accumulate", "resumed", "trigger_sync"):
        assert_equal_on_ranks([r["minddp"][scenario]["params"] for r in ranks], scenario)

    # Without the one line, a model the user wrapped in minddp's DDP is wrapped again in
    # torch's, which would reduce every gradient twice: minddp refuses at the first forward,
    # on every rank, saying what to do instead.
    for rank, result in enumerate(ranks):
        error = result["prewrapped"]["error"]
        assert error is not None, f"rank {rank}: a double wrap trained without an error"
        assert "reduced twice" in error and "replace_torch_ddp" in error, error


@needs("transformers", "accelerate")
def test_hf_trainer_with_the_one_line_matches_stock(tmp_path):
    """torchrun, a tiny GPT-2 from a config: Trainer with gradient accumulation and clipping,
    save_model, from_pretrained."""
    ranks = launch(TORCHRUN + [str(SCRIPTS / "hf_trainer_run.py")], tmp_path, timeout=240)
    for rank, result in enumerate(ranks):
        stock, ours = result["stock"], result["minddp"]
        assert ours["wrappers"] == ["minddp.swap"], ours["wrappers"]
        assert stock["wrappers"] == ["torch.nn.parallel.distributed"], stock["wrappers"]
        torch.testing.assert_close(ours["losses"], stock["losses"], rtol=1e-6, atol=1e-7)
        for key in ("params", "reloaded"):
            assert_close(ours[key], stock[key], f"rank {rank}, {key}")
        assert_close(ours["reloaded"], ours["params"], "from_pretrained against the trained")
    assert_equal_on_ranks([r["minddp"]["params"] for r in ranks], "HF Trainer")


@needs("lightning")
def test_lightning_module_registers_for_both_package_names():
    """`import minddp.lightning` registers "minddp"; the pytorch_lightning class is built on
    demand and registered there; minddp's keywords go to the wrapper, the rest to DDPStrategy."""
    code = """
import sys, datetime, pickle
import minddp, minddp.lightning as ml
from lightning.pytorch.strategies import StrategyRegistry, DDPStrategy
assert "pytorch_lightning" not in sys.modules
names = [n for n, _ in ml.NAMES]
assert all(n in StrategyRegistry for n in names), names
assert StrategyRegistry["minddp"]["strategy"] is ml.MinddpStrategy
s = ml.MinddpStrategy(algorithm="ring", compression="fp16", timeout=30, static_graph=True)
assert s._minddp_kwargs == {"algorithm": "ring", "compression": "fp16",
                            "timeout": datetime.timedelta(seconds=30)}, s._minddp_kwargs
assert s._ddp_kwargs == {"static_graph": True} and s._timeout == datetime.timedelta(seconds=30)
assert isinstance(s, DDPStrategy) and type(pickle.loads(pickle.dumps(s))) is ml.MinddpStrategy
try:
    import pytorch_lightning
except ImportError:
    print("ok without pytorch_lightning")
else:
    from pytorch_lightning.strategies import StrategyRegistry as PLRegistry, DDPStrategy as PLDDP
    assert issubclass(ml.MinddpStrategyPL, PLDDP)
    assert PLRegistry["minddp"]["strategy"] is ml.MinddpStrategyPL
    print("ok with pytorch_lightning")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("ok"), done.stdout


def test_minddp_does_not_import_lightning():
    """Lightning is an optional dependency, imported by minddp/lightning.py only."""
    code = "import sys, minddp; print(sorted(m for m in sys.modules if 'lightning' in m))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    sources = [p for p in (ROOT / "minddp").rglob("*.py") if p.name != "lightning.py"]
    assert not [p for p in sources if "import lightning" in p.read_text() or
                "from lightning" in p.read_text()]
