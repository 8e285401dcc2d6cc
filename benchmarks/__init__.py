"""Shared benchmark code (measure, workloads, configs, plots, pool), importable as
`benchmarks.*` once minddp is installed (`make setup`). The scripts here run as files:
`torchrun --nproc_per_node=2 benchmarks/compare.py`."""
