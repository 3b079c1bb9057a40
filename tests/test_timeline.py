"""engine.memory_timeline: the PNG a user reads to pick a budget."""

import pytest
import torch
from conftest import tiny_gpt, tokens

from fxstar.engine import compile
from fxstar.plan import Plan


def test_timeline_png_of_the_last_training_step(tmp_path):
    pytest.importorskip("matplotlib")
    ids, targets = tokens()
    engine = compile(tiny_gpt(), Plan(device_memory="10MiB"), (ids, targets))
    engine(ids, targets).backward()
    with torch.no_grad():
        engine.eval()
        engine(ids, targets)  # an evaluation forward does not replace the training step
    path = engine.memory_timeline(tmp_path / "timeline.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert any(m.phase == "backward" for m in engine.chunks.tracer.training_step())


def test_timeline_needs_the_chunk_engine():
    engine = compile(tiny_gpt(), Plan(), tokens())
    with pytest.raises(ValueError, match="device_memory"):
        engine.memory_timeline("x.png")
