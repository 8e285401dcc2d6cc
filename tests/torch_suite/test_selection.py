"""selection.py accounts for every DDP test torch ships, once, and its tables agree.

Reads torch's distributed_test.py as text (no import: it changes global torch
flags when imported). The accounting is checked against the torch version the
tables were written for; another version is reported, not failed.
"""
import ast
import importlib.util
import os
import re

import pytest

from . import selection

WRITTEN_FOR = "2.13."  # the torch whose distributed_test.py selection.py accounts for
# Ports whose name is not test_ported_ + the upstream name without test_; None:
# the device-independent half of a test that EXCLUDED accounts for.
PORTED_FROM = {"test_ported_ddp_uneven_inputs_stop_iteration_with_comm": None}


def _torch_ddp_tests():
    """(torch version, names of _DistTestBase's tests that construct DDP, directly or
    through the helpers they call)."""
    torch_dir = os.path.dirname(importlib.util.find_spec("torch").origin)
    path = os.path.join(torch_dir, "testing", "_internal", "distributed", "distributed_test.py")
    with open(os.path.join(torch_dir, "version.py")) as f:
        version = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read()).group(1)
    with open(path) as f:
        source = f.read()
    base = next(node for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ClassDef) and node.name == "_DistTestBase")
    lines = source.splitlines()
    methods = {node.name: "\n".join(lines[node.lineno - 1:node.end_lineno])
               for node in base.body if isinstance(node, ast.FunctionDef)}

    def builds_ddp(name, seen):
        if name in seen:
            return False
        seen.add(name)
        body = methods[name]
        return "DistributedDataParallel" in body or any(
            builds_ddp(helper, seen) for helper in re.findall(r"self\.(_\w+)\(", body)
            if helper in methods)

    return version, set(methods), {n for n in methods
                                   if n.startswith("test_") and builds_ddp(n, set())}


def _upstream_of(port):
    return PORTED_FROM.get(port, "test_" + port[len("test_ported_"):])


def test_tables_agree():
    ported = selection.ported_tests()
    selected = selection.UPSTREAM + ported
    assert len(set(selected)) == len(selected), "a test is selected twice"
    assert not set(selection.KNOWN_FAILURES) - set(selected), \
        "KNOWN_FAILURES names tests that are not selected"
    assert not set(selection.TIMEOUTS) - set(selected), "TIMEOUTS names tests that are not selected"
    ported_from = [_upstream_of(p) for p in ported if _upstream_of(p)]
    accounted = selection.UPSTREAM + ported_from + list(selection.EXCLUDED)
    twice = {n for n in accounted if accounted.count(n) > 1}
    assert not twice, f"accounted for more than once (selected, ported or excluded): {twice}"


def test_every_torch_ddp_test_is_accounted_for():
    version, methods, ddp_tests = _torch_ddp_tests()
    if not version.startswith(WRITTEN_FOR):
        pytest.skip(f"selection.py accounts for torch {WRITTEN_FOR}x's DDP tests; this is "
                    f"torch {version}, whose list may differ")
    ported_from = {_upstream_of(p) for p in selection.ported_tests() if _upstream_of(p)}
    accounted = set(selection.UPSTREAM) | ported_from | set(selection.EXCLUDED)
    assert not ddp_tests - accounted, \
        f"DDP tests in torch {version} that selection.py neither selects, ports nor excludes"
    assert not accounted - methods, \
        f"selection.py names tests that torch {version} does not have"
    assert len(ddp_tests) >= 40
