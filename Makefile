# make test   set up .venv (first time) and run the test suite
# make bench  set up .venv (first time) and run the side-by-side benchmark
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
STAMP  := $(VENV)/.minddp-installed

.PHONY: test bench setup clean

setup: $(STAMP)

$(STAMP): setup.py tools/make_venv.sh $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*)
	bash tools/make_venv.sh $(VENV)
	touch $@

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) benchmarks/compare.py

clean:
	rm -rf $(VENV) build minddp/_C*.so *.egg-info
