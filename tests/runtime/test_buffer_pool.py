"""The buffers recompute mode re-gathers into."""

import torch

from fxstar.runtime.buffer_pool import BufferPool


def test_buffer_pool_reuses_one_buffer_per_purpose():
    like = torch.empty(0)
    pool = BufferPool()
    a = pool.get("t_pool", (4, 8), like)
    b = pool.get("t_pool", (2, 8), like)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    c = pool.get("t_pool", (8, 8), like)  # grows
    assert c.shape == (8, 8)
