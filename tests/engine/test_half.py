"""The KV cache's f16 conversions (engine/half.h): the plain C ones give the bits F16C gives,
on every f16 and across every rounding case of floats, and round as IEEE 754 says (Python's
own binary16 packing is the reference)."""
from __future__ import annotations

import math
import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def half_check(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("half") / "half_check"
    subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(ROOT / "engine"),
                    str(ROOT / "tests" / "engine" / "half_check.c"), "-o", str(out)], check=True)
    return out


def test_plain_conversions_give_the_bits_f16c_gives(half_check):
    run = subprocess.run([str(half_check)], capture_output=True, text=True, timeout=300)
    if run.returncode == 2:
        pytest.skip("this CPU has no F16C")
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.split()[2]) > 20_000_000, run.stdout


def _expected(bits: int) -> int:
    x = struct.unpack("<f", struct.pack("<I", bits))[0]
    try:
        return struct.unpack("<H", struct.pack("<e", x))[0]
    except OverflowError:   # Python refuses what rounds past 65504; IEEE says infinity
        return (bits >> 16 & 0x8000) | 0x7C00


def test_rounding_is_ieee_nearest_even(half_check):
    rng = random.Random(7)
    cases = [0, 0x80000000, 0x7F800000, 0xFF800000,          # zeros, infinities
             0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000,  # 65504, just under its tie, at it
             0x33000000, 0x33000001, 0x38800000, 0x387FFFFF,  # 2^-25 (ties to 0), the normal edge
             0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001]  # ties to even both ways, near them
    cases += [rng.getrandbits(32) for _ in range(20_000)]
    cases += [(rng.randrange(98, 116) << 23 | rng.getrandbits(23)) ^ rng.choice((0, 1 << 31))
              for _ in range(20_000)]   # the subnormals and the normal edge, densely
    finite = [b for b in cases if not math.isnan(struct.unpack("<f", struct.pack("<I", b))[0])]
    run = subprocess.run([str(half_check), "--print"], input="\n".join(f"{b:08x}" for b in finite),
                         capture_output=True, text=True, check=True, timeout=60)
    got = [int(line, 16) for line in run.stdout.split()]
    wrong = [(f"{b:08x}", f"{g:04x}", f"{_expected(b):04x}") for b, g in zip(finite, got)
             if g != _expected(b)]
    assert len(got) == len(finite) and not wrong, wrong[:5]
