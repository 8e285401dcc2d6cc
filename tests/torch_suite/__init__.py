"""torch's own DDP tests against torch's DDP and minddp: see test_suite.py."""
