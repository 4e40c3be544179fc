"""The logits a request adjusts (serve/engine/decode.py's Adjustment): OpenAI's definition,
logit + bias - count * frequency_penalty - (count > 0) * presence_penalty."""
from __future__ import annotations

import numpy as np
import pytest

from serve.engine.decode import Adjustment


def test_bias_and_penalties_as_openai_defines_them():
    logits = np.frombuffer(np.arange(6, dtype=np.float32).tobytes(), dtype=np.float32)
    adjusted = Adjustment({1: 10.0, 4: -100.0}, frequency=0.5, presence=1.0).apply(
        logits, [2, 2, 2, 3])
    assert adjusted.tolist() == pytest.approx([0, 11, 2 - 1.5 - 1, 3 - 0.5 - 1, -96, 5])
    assert logits.tolist() == [0, 1, 2, 3, 4, 5]   # the engine's buffer is left as it was


def test_nothing_to_adjust_is_inactive():
    assert not Adjustment().active
    assert Adjustment(presence=-0.5).active and Adjustment({3: 1.0}).active
