#!/usr/bin/env python3
"""WARP's whole engine against the recorded fixture: is waste_tokenize what its
tokenizer.c gave tools/warp_oracle.py, and is serve's "warp" tokenizer equal to it?

    tools/warp_lib_check.py WARP_SOURCE_DIR

Builds WARP's libwaste.so (`make -C WARP_SOURCE_DIR libwaste.so`) and one of its
test containers (its tools/make_test_container.py: a few hundred KB of noise that
waste_open accepts), replaces the container's tokenizer files with the fixture's
vocabulary, and tokenizes every fixture text through WARP's waste_tokenize and
waste_tokenize_markup (serve's ctypes binding: the ABI is the same) and through
serve's own tokenizer for the container. By hand, not in CI: it needs WARP.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import BpeTokenizer, Engine, EngineConfig, load_library, load_vocabulary  # noqa: E402
from warp_oracle import fixture_tokens, read_fixture, write_vocabulary  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("warp", type=Path, help="a checkout of WARP's source")
    args = parser.parse_args()
    subprocess.run(["make", "-C", str(args.warp), "libwaste.so"], check=True, capture_output=True)
    fixture = read_fixture()
    with tempfile.TemporaryDirectory() as tmp:
        container = Path(tmp) / "test.waste"
        subprocess.run([sys.executable, str(args.warp / "tools" / "make_test_container.py"),
                        str(container)], check=True, capture_output=True)
        write_vocabulary(container, fixture_tokens(fixture), fixture["specials"])
        ours = BpeTokenizer(load_vocabulary(container))
        lib = load_library(str(args.warp / "libwaste.so"))
        engine_differs = serve_differs = asked = 0
        with Engine(lib, container, EngineConfig()) as engine:
            for case in fixture["cases"]:
                runs = [(False, case["ids"])]
                if "markup_ids" in case:
                    runs.append((True, case["markup_ids"]))
                for markup, want in runs:
                    asked += 1
                    got = engine.tokenize(case["text"], markup=markup)
                    engine_differs += got != want
                    serve_differs += got != (ours.tokenize_markup(case["text"]) if markup
                                             else ours.tokenize(case["text"]))
    print(f"{asked} tokenizations: WARP's waste_tokenize differs from its recorded tokenizer.c "
          f"on {engine_differs}; serve's own ({ours.pretokenizer}) from waste_tokenize on "
          f"{serve_differs}")
    sys.exit(1 if engine_differs or serve_differs else 0)


if __name__ == "__main__":
    main()
