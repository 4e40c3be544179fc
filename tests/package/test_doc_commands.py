"""The scripts the docs show as commands run as they are shown: `tools/x.py ARGS` needs a shebang
and the run bit; one shown after an interpreter (`python3 tools/x.py`) needs neither."""
from __future__ import annotations

import os
import re

from conftest import ROOT

# A code span that begins with a script's path: the docs show it run as a command.
COMMAND = re.compile(r"`((?:tools|bench|deploy)/[\w/]+\.py)(?: [^`]*)?`")


def commands() -> set[str]:
    found = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in COMMAND.finditer(page.read_text()):
            # Only a span with arguments is a command; a bare path names the file.
            if match.group(0) != f"`{match.group(1)}`":
                found.add(match.group(1))
    return found


def test_every_script_shown_as_a_command_runs_as_one():
    shown = commands()
    assert "tools/make_container.py" in shown   # docs/engine.md's
    for script in shown:
        path = ROOT / script
        assert os.access(path, os.X_OK), f"{script} is shown as a command but has no run bit"
        assert path.read_text().startswith("#!/usr/bin/env python3\n"), f"{script} has no shebang"
