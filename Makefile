# make test   set up .venv (first time) and run the test suite
# make bench  set up .venv (first time) and run the side-by-side benchmark
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
STAMP  := $(VENV)/.minddp-installed

.PHONY: test bench setup clean gpu-check

setup: $(STAMP)

$(STAMP): setup.py tools/make_venv.sh $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*)
	bash tools/make_venv.sh $(VENV)
	touch $@

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) benchmarks/compare.py

# On a machine with CUDA: build with the CUDA kernels, run the GPU tests and short
# GPU benchmarks, log to results/gpu-check.log (tools/gpu_check.sh says more).
gpu-check:
	VENV=$(VENV) bash tools/gpu_check.sh

clean:
	rm -rf $(VENV) build minddp/_C*.so *.egg-info
