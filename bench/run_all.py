"""Every benchmark, one after the other, on the demo container: `make bench`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["engine_decode.py", "stream_overhead.py", "multiturn.py", "prompt_build.py", "slow_agent.py",
           "snapshot_cost.py", "constrained.py", "preamble.py", "dialects.py", "renders.py",
           "heartbeats.py", "prefill_step.py", "chores.py", "chores_model.py", "tokenizer.py",
           "busy_answers.py", "image_check.py"]

for name in BENCHES:
    print(f"== {name}", flush=True)
    subprocess.run([sys.executable, str(HERE / name), *sys.argv[1:]], check=True)
    print(flush=True)
