# make test   set up .venv (first time) and run the test suite (in TEST_WORKERS=3 pytest workers)
# make bench  set up .venv (first time) and run the side-by-side benchmark
# make lint   set up .venv (first time) and run ruff over the repository (pyproject.toml)
# make docs   regenerate docs/results.md and the tables of README and docs/performance.md
# make results  rerun the benchmarks behind docs/results.md (about 5 minutes on 2 cores)
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
STAMP  := $(VENV)/.minddp-installed

.PHONY: test bench lint setup clean gpu-check docs results

setup: $(STAMP)

$(STAMP): setup.py tools/make_venv.sh $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*)
	bash tools/make_venv.sh $(VENV)
	touch $@

# The tests run in TEST_WORKERS pytest workers (pytest-xdist, which tools/make_venv.sh
# installs; TEST_WORKERS=0: in one process, as where the venv has no xdist, the offline GPU
# machine). Three on two cores, as tests spend part of their time waiting on a timeout or a peer.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(PY) -m pytest tests $$($(PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS)")

# ruff comes with the venv (tools/make_venv.sh) where pip could fetch it; without it lint
# fails, saying so, rather than passing unchecked.
lint: $(STAMP)
	@$(PY) -m ruff --version >/dev/null 2>&1 || { echo "make lint: ruff is not installed in" \
	    "$(VENV) (tools/make_venv.sh skips it where pip is offline): $(PY) -m pip install ruff"; \
	    exit 1; }
	$(PY) -m ruff check .

RUN := $(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC)
bench: $(STAMP)
	$(RUN) benchmarks/compare.py

docs: $(STAMP)
	$(PY) benchmarks/report.py

results: $(STAMP)
	$(RUN) benchmarks/compare.py --steps 30 --timeline --out docs/results
	$(RUN) benchmarks/collectives.py --model --algorithms native ring tree halving_doubling auto native_again --out docs/results
	$(PY) benchmarks/kernels.py --json docs/results/kernels.json
	$(PY) benchmarks/report.py

# On a machine with CUDA: build with the CUDA kernels, run the GPU tests and short
# GPU benchmarks, log to results/gpu-check.log (tools/gpu_check.sh says more).
gpu-check:
	VENV=$(VENV) bash tools/gpu_check.sh

clean:
	rm -rf $(VENV) build minddp/_C*.so *.egg-info
