"""Shared benchmark code (measure, workloads, configs, plots, pool), importable as
`benchmarks.*` from the checkout (`make setup` puts it on the venv's path; setup.py
installs minddp only). The scripts here run as files:
`torchrun --nproc_per_node=2 benchmarks/compare.py`."""
