"""The README and docs/ stay true: every command they show names a script, flags and make
targets that exist, every path and link they give exists, and the generated results are
in step with the result files they come from."""
import functools
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The scripts import `benchmarks` and `examples` from the checkout, which setup.py does not
# install: as README says, they run with it on PYTHONPATH (make's .venv needs none).
SCRIPT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
PATH_PREFIXES = ("minddp/", "benchmarks/", "examples/", "docs/", "tests/", "tools/", "csrc/")


def _text(page):
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def _commands(page):
    """Shell commands shown in the page: lines of sh blocks, and inline code spans that
    run a make target or a script, that start with make, torchrun, python or sudo
    (comments after # dropped)."""
    text = _text(page)
    candidates = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        candidates += block.splitlines()
    candidates += [span for span in re.findall(r"`([^`\n]+)`", text)
                   if span.startswith("make ") or re.search(r"\S+/\S+\.(py|sh)\b", span)]
    found = []
    for line in candidates:
        line = re.sub(r"\s+#.*$", "", line).strip()
        words = line.split()
        while words and re.match(r"^[A-Z_]+=", words[0]):  # NPROC=4 make bench
            words = words[1:]
        if words and words[0] in ("make", "torchrun", "python", "sudo"):
            found.append(words)
    return found


def _script(words):
    """(script path, its arguments) for a command that runs a file of this repo."""
    for i, w in enumerate(words):
        if w.endswith((".py", ".sh")) and "/" in w and "=" not in w:
            return w, words[i + 1:]
    return None, []


ALL = [(page, words) for page in PAGES for words in _commands(page)]


def test_pages_show_commands():
    assert len(ALL) >= 20, f"found only {len(ALL)} commands: the extraction is broken"
    assert ["make", "bench"] in [w for _, w in ALL] and ["make", "test"] in [w for _, w in ALL]


@pytest.mark.parametrize("page,words", ALL, ids=[f"{p}:{' '.join(w)}" for p, w in ALL])
def test_command_exists(page, words):
    if words[0] == "make":
        with open(os.path.join(ROOT, "Makefile")) as f:
            targets = set(re.findall(r"^([\w-]+):", f.read(), re.M))
        for target in words[1:]:
            assert target in targets, f"{page}: `make {target}` is not a Makefile target"
        return
    script, args = _script(words)
    if script is None:
        assert words[:2] == ["torchrun", "--nproc_per_node=2"] and words[-1].endswith(".py"), \
            f"{page}: {' '.join(words)} runs no script of this repo"
        return
    assert os.path.exists(os.path.join(ROOT, script)), f"{page}: {script} does not exist"
    flags = [a.split("=")[0] for a in args if a.startswith("--")]
    if not flags:
        return
    if script.endswith(".sh"):  # multinode.sh hands its flags to $SCRIPT (compare.py)
        chosen = [w.split("=", 1)[1] for w in words if w.startswith("SCRIPT=")]
        script = chosen[0] if chosen else "benchmarks/compare.py"
    returncode, stdout, stderr = _help(script)
    assert returncode == 0, stderr
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", stdout), \
            f"{page}: {script} has no option {flag}"


@functools.lru_cache(maxsize=None)
def _help(script):
    """(exit status, stdout, stderr) of `python script --help`: run once per script, not
    once per command that uses it (each run imports torch, seconds of CPU)."""
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=SCRIPT_ENV,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def test_paths_and_links_exist():
    missing = []
    for page in PAGES:
        text, here = _text(page), os.path.dirname(os.path.join(ROOT, page))
        for link in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" not in link and not os.path.exists(os.path.join(here, link)):
                missing.append(f"{page}: link {link}")
        for span in re.findall(r"`([^`\n]+)`", text):
            for word in shlex.split(span, posix=False) if span.startswith(PATH_PREFIXES) else []:
                path = word.rstrip(",.:;)")
                if path.startswith(PATH_PREFIXES) and "*" not in path and "<" not in path \
                        and not os.path.exists(os.path.join(ROOT, path)):
                    missing.append(f"{page}: path {path}")
    assert not missing, "\n".join(missing)


def test_generated_results_are_current():
    """docs/results.md, README's table and docs/performance.md's tables match the committed
    result files (make docs)."""
    out = subprocess.run([sys.executable, "benchmarks/report.py", "--check"], cwd=ROOT,
                         env=SCRIPT_ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for page in ("README.md", "docs/results.md", "docs/performance.md"):
        assert "torch_ddp" in _text(page), f"{page} shows no results table"


def _modules():
    """Every module and subpackage of minddp/, as paths relative to minddp/ ('reducer.py',
    'algorithms/', 'algorithms/ring.py'), __init__ files aside."""
    found = []
    for folder, dirs, files in os.walk(os.path.join(ROOT, "minddp")):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        rel = os.path.relpath(folder, os.path.join(ROOT, "minddp"))
        prefix = "" if rel == "." else rel + "/"
        found += [prefix + d + "/" for d in dirs]
        found += [prefix + f for f in files if f.endswith(".py") and f != "__init__.py"]
    return sorted(found)


def test_the_layouts_name_every_module():
    """README's layout names every top-level module and subpackage, docs/design.md every
    module (subpackages' too), and neither names one that is gone."""
    layout = re.search(r"## Layout\n+```\n(.*?)```", _text("README.md"), re.S).group(1)
    listed = set(re.findall(r"^minddp/(\S+)", layout, re.M))
    top = {m for m in _modules() if m.count("/") == 0 or (m.endswith("/") and m.count("/") == 1)}
    assert top - listed == set(), f"README layout lacks {sorted(top - listed)}"
    assert listed - top == set(), f"README layout names what is gone: {sorted(listed - top)}"
    design = _text("docs/design.md")
    unnamed = [m for m in _modules() if not m.endswith("/") and f"`{m}`" not in design and
               f"`{m.split('/')[-1]}`" not in design]
    assert not unnamed, f"docs/design.md never names {unnamed}"
    assert len(_modules()) > 30  # the walk found the package
