"""serve's version: pyproject.toml's, the one place it is written.

From a checkout (the Makefile's demo, `python3 -m serve` in the tree) that
file is next to the package and is read; an installed package has it in its
metadata instead.
"""
from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def version() -> str:
    try:
        with open(PYPROJECT, "rb") as f:
            project = tomllib.load(f).get("project", {})
        if project.get("name") == "serve":
            return str(project["version"])
    except (OSError, tomllib.TOMLDecodeError, KeyError):
        pass
    try:
        return metadata.version("serve")
    except metadata.PackageNotFoundError:
        return "unknown"
