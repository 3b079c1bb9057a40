"""Step headers, in-process: the message every rank raises and the fingerprints in a header.
What really happens between ranks (a rank that raised mid-forward and went on, a shape on one
rank, tensor-parallel ranks fed different inputs) is tested on spawned ranks in
test_data_parallel.py and test_agreement.py."""

import torch

from fxstar.runtime.step_check import (
    MAGIC,
    SAMPLE_BYTES,
    _capture_key,
    _inputs_crc,
    out_of_step_message,
)


def _row(step=3, forward=8, collective=4, capture=7, what=1, inputs=0, magic=MAGIC):
    return [magic, step, forward, collective, capture, what, inputs]


def test_ranks_out_of_step_are_named_with_where_each_is():
    rows = [_row(), _row(forward=9, collective=0, what=2), _row()]
    texts = [("all-gathering chunks 2 to 3", "train (int64[2,16])"),
             ("broadcasting the buffers", "train (int64[2,16])")] * 2  # fmt: skip
    text = out_of_step_message(rows, texts[:3], "data-parallel")
    assert text.startswith("the data-parallel ranks are out of step")
    assert "ranks 0, 2: step 3, training forward 8, its collective 4: all-gathering chunks" in text
    assert "rank 1: step 3, training forward 9, its collective 0: broadcasting the buffers" in text
    assert "try/except" in text and "fix: every rank must run the same forwards" in text
    assert "input signatures" not in text and "different inputs" not in text


def test_a_shape_on_some_ranks_and_different_inputs_are_named():
    rows = [_row(what=1), _row(capture=8, what=5)]
    texts = [("broadcasting the buffers", "train (int64[2,16], int64[2,16])"),
             ("all_gather_object (comparing plans, at compile)",
              "train (int64[2,8], int64[2,8])")]  # fmt: skip
    text = out_of_step_message(rows, texts, "data-parallel")
    assert "run different input signatures" in text
    assert "rank 0: train (int64[2,16], int64[2,16])" in text
    assert "rank 1: train (int64[2,8], int64[2,8])" in text and "drop_last=True" in text
    text = out_of_step_message([_row(inputs=5), _row(inputs=6)], texts, "tensor-parallel")
    assert text.startswith("the tensor-parallel ranks were fed different inputs: rank 0: "
                           "crc32=00000005; rank 1: crc32=00000006")  # fmt: skip
    assert "out of step" not in text


def test_a_rank_in_another_collective_is_named_without_its_text():
    rows = [_row(), [123, 0, 0, 0, 0, 0, 0]]
    text = out_of_step_message(rows, None, None)
    assert "the ranks of the engine's process group are out of step" in text
    assert "rank 0: step 3, training forward 8, its collective 4\n" in text
    assert "rank 1: in a collective that is not one of the engine's steps" in text


def test_the_capture_key_follows_the_engines_and_leaves_devices_out():
    a, b = torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)
    shown, crc = _capture_key(True, (a, a), {}, dynamic=False)
    assert shown == "train (int64[2,16], int64[2,16])"
    assert crc != _capture_key(True, (b, b), {}, dynamic=False)[1]
    assert crc != _capture_key(False, (a, a), {}, dynamic=False)[1]
    assert crc != _capture_key(True, (a,), {"targets": a}, dynamic=False)[1]  # structure
    # under dynamic shapes one capture serves every length
    assert _capture_key(True, (a,), {}, dynamic=True) == _capture_key(True, (b,), {}, dynamic=True)
    assert _capture_key(True, (a.to("meta"),), {}, False) == _capture_key(True, (a,), {}, False)


def test_the_inputs_fingerprint_sees_one_changed_value_and_samples_large_inputs():
    ids = torch.arange(32).view(2, 16)
    other = ids.clone()
    other[1, 7] = 0
    assert _inputs_crc((ids,), {}) == _inputs_crc((ids.clone(),), {})
    assert _inputs_crc((ids,), {}) != _inputs_crc((other,), {})
    assert _inputs_crc((ids,), {}) != _inputs_crc((ids.view(4, 8),), {})  # the shape too
    assert _inputs_crc((ids,), {"n": 1}) != _inputs_crc((ids,), {"n": 2})
    big = torch.zeros(SAMPLE_BYTES // 2, dtype=torch.float32)  # twice the sample: stride 2
    changed = big.clone()
    changed[2] = 1.0  # a sampled element
    assert _inputs_crc((big,), {}) != _inputs_crc((changed,), {})
