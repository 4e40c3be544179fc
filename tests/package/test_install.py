"""The package: `pip install` into a fresh virtual environment, with no package index, gives a
working `serve` command and `python -m serve`; the runtime needs nothing but the standard library."""
from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from conftest import ROOT

# The build backend (pyproject.toml's build-system), fetched once by `make` into a local directory.
WHEELHOUSE = ROOT / "build" / "wheelhouse"


def run(*args, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    # The machine's own pip configuration (indexes, local wheel directories) stays out of it.
    full = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env}
    full.pop("WASTE_LIB", None)
    return subprocess.run([str(a) for a in args], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A virtual environment with serve installed from a copy of this checkout's package."""
    if not list(WHEELHOUSE.glob("setuptools-*.whl")):
        pytest.fail(f"{WHEELHOUSE} has no setuptools wheel: run `make` targets test or check")
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"   # a copy: building writes into the source tree
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "serve", source / "serve", ignore=shutil.ignore_patterns("__pycache__"))
    env = tmp / "venv"
    venv.create(env, with_pip=True)
    done = run(env / "bin" / "python", "-m", "pip", "install", "--no-index", "--find-links", WHEELHOUSE,
               source, cwd=tmp)
    assert done.returncode == 0, done.stdout + done.stderr
    return env


def test_the_serve_command_and_the_module_answer_help(installed):
    command = run(installed / "bin" / "serve", "--help", cwd=installed)
    module = run(installed / "bin" / "python", "-m", "serve", "--help", cwd=installed)
    assert command.returncode == 0 and command.stdout.startswith("usage: serve "), command.stderr
    assert module.returncode == 0 and module.stdout.startswith("usage: python3 -m serve "), module.stderr
    assert "--no-thinking" in command.stdout and "--lib" in command.stdout


def test_the_version_is_pyproject_s_from_the_package_and_from_a_checkout(installed):
    import tomllib
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    command = run(installed / "bin" / "serve", "--version", cwd=installed)   # the metadata's
    module = run(installed / "bin" / "python", "-m", "serve", "--version", cwd=installed)
    checkout = run(installed / "bin" / "python", "-m", "serve", "--version", cwd=ROOT)   # the file's
    for done in (command, module, checkout):
        assert (done.returncode, done.stdout) == (0, f"serve {expected}\n"), done.stderr


def test_nothing_but_the_package_is_installed_and_the_page_comes_with_it(installed):
    listed = run(installed / "bin" / "python", "-m", "pip", "list", "--format=freeze", cwd=installed)
    names = {line.split("==")[0].lower() for line in listed.stdout.split()}
    assert names - {"pip", "setuptools"} == {"serve"}
    page = run(installed / "bin" / "python", "-c",
               "from serve.http.page import chat_page; print(len(chat_page()[0]))", cwd=installed)
    assert page.returncode == 0 and int(page.stdout) > 1000, page.stderr


def test_without_an_engine_library_it_says_what_to_do_in_one_line(installed, tmp_path):
    done = run(installed / "bin" / "serve", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("serve: no usable libwaste; tried ")
    assert "`make`" in line and "--lib" in line and "$WASTE_LIB" in line
