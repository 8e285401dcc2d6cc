"""setup.py installs the package minddp and nothing else: a top-level `benchmarks` or
`examples` in site-packages would collide with other projects' (they run from the checkout)."""
import os
import runpy

import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_setup_installs_minddp_only(monkeypatch):
    """Runs setup.py with setuptools.setup replaced by a recorder (no build, no torch import:
    MINDDP_NO_EXTENSION=1) and checks the package list it would install."""
    calls = []
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setenv("MINDDP_NO_EXTENSION", "1")
    monkeypatch.chdir(ROOT)  # find_packages looks in the working directory
    runpy.run_path("setup.py", run_name="__main__")
    assert len(calls) == 1, f"setup.py called setup() {len(calls)} times"
    packages = calls[0]["packages"]
    assert "minddp" in packages and "minddp.algorithms" in packages, packages
    others = [p for p in packages if p != "minddp" and not p.startswith("minddp.")]
    assert not others, f"setup.py would install {others} into site-packages; install minddp only"
    assert not calls[0].get("py_modules"), "setup.py would install top-level modules"
