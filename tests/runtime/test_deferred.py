"""Deferred tensors (fxstar/runtime/deferred.py): a writer's layout and values, each group read
once, after the tensors in memory; values of their own; a source that strays is named."""

import pytest
import torch

from fxstar.runtime.deferred import DeferredTensor, in_groups, read_values


class Source:
    """Groups of tensors in memory, read as a DeferredSource: it records each group read and
    gives `stray` in place of the group asked for, when set."""

    def __init__(self, groups: dict[str, dict[str, torch.Tensor]], stray: str | None = None):
        self.groups, self.stray, self.reads = groups, stray, []

    def read(self, groups):
        for group in groups:
            self.reads.append(group)
            given = self.stray or group
            yield given, self.groups[given]

    def deferred(self, group: str, name: str) -> DeferredTensor:
        t = self.groups[group][name]
        return DeferredTensor(tuple(t.shape), t.dtype, self, group, name)


def source(stray: str | None = None) -> Source:
    first = {"p": torch.arange(6.0).view(2, 3), "r": torch.tensor([7], dtype=torch.uint8)}
    return Source({"g1": first, "g2": {"q": torch.ones(4, dtype=torch.bfloat16)}}, stray)


def test_a_writer_gets_the_tensors_in_memory_then_each_group_read_once():
    s = source()
    step = torch.tensor(3.0)
    tensors = {"x0": s.deferred("g1", "p"), "step": step, "y0": s.deferred("g2", "q"),
               "x1": s.deferred("g1", "r")}  # fmt: skip
    layout, pairs = in_groups(tensors)
    assert list(layout) == ["step", "x0", "x1", "y0"]
    assert layout["step"] is step
    for key in ("x0", "x1", "y0"):
        assert layout[key].is_meta
        assert (layout[key].shape, layout[key].dtype) == (tensors[key].shape, tensors[key].dtype)
    assert s.reads == []  # nothing is read before the writer asks
    drawn = list(pairs)
    assert [k for k, _ in drawn] == list(layout)
    expected = {"step": step, "x0": s.groups["g1"]["p"], "x1": s.groups["g1"]["r"],
                "y0": s.groups["g2"]["q"]}  # fmt: skip
    assert all(torch.equal(v, expected[k]) for k, v in drawn)
    assert s.reads == ["g1", "g2"]


def test_tensors_without_deferred_ones_are_written_as_given():
    tensors = {"b": torch.ones(2), "a": torch.zeros(3)}
    layout, pairs = in_groups(tensors)
    assert layout == tensors and list(pairs) == list(tensors.items())


def test_read_values_gives_tensors_of_their_own():
    s = source()
    values = read_values([s.deferred("g2", "q"), s.deferred("g1", "p"), s.deferred("g1", "r")])
    originals = [s.groups["g2"]["q"], s.groups["g1"]["p"], s.groups["g1"]["r"]]
    for value, original in zip(values, originals, strict=True):
        assert torch.equal(value, original)
        assert value.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
    assert s.reads == ["g2", "g1"]


def test_a_source_that_gives_another_group_is_named():
    s = source(stray="g2")
    with pytest.raises(RuntimeError, match="gave group 'g2' where 'g1' was asked for"):
        read_values([s.deferred("g1", "p")])
