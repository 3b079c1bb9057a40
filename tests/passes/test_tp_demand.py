"""tp_demand: where a split starts when an op needs a whole operand split, on exported
graphs: a parameter through casts and reshapes, a fresh tensor, a broadcast, and why not."""

import torch

from fxstar.passes.tp_demand import Seed, find_seeds


class _Fn(torch.nn.Module):
    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for name, value in params.items():
            self.register_parameter(name, torch.nn.Parameter(value))
        self.register_buffer("buf", torch.ones(8))

    def forward(self, x):
        return self.fn(self, x)


def _seeds(fn, dim: int, **params):
    """The seeds that split the output of `fn` (exported on a [2, 8, 4] input) on `dim`."""
    exported = torch.export.export(_Fn(fn, **params), (torch.randn(2, 8, 4),), strict=False)
    output = next(node for node in exported.graph.nodes if node.op == "output")
    node = output.args[0][0]

    def splittable(placeholder) -> str:
        return "" if placeholder.name.startswith("p_") else f"{placeholder.name} is no parameter"

    return find_seeds(node, dim, 2, {}, splittable, "q_proj")


def test_a_parameter_through_casts_and_reshapes_is_split_on_its_own_dim():
    # Mamba's A: -exp(A_log.float()) broadcast as [1, channels, 1, state]
    seeds = _seeds(lambda m, x: -torch.exp(m.a.float())[None, :, None, :], 1, a=torch.ones(8, 4))
    assert seeds == [Seed("p_a", 0, "parameter", "q_proj")]
    # a conv weight squeezed and unsqueezed, and a sum of two parameters: both split
    seeds = _seeds(lambda m, x: m.w.squeeze(1).unsqueeze(1) + m.b[:, None, None], 0,
                   w=torch.ones(8, 1, 3), b=torch.ones(8))  # fmt: skip
    assert {(s.node, s.dim) for s in seeds} == {("p_w", 0), ("p_b", 0)}


def test_fresh_tensors_and_broadcasts_start_with_per_rank_sizes():
    (seed,) = _seeds(lambda m, x: torch.zeros(2, 8, 16) * 2, 1)
    assert (seed.kind, seed.args) == ("fresh", ([2, 4, 16],))
    (seed,) = _seeds(lambda m, x: x.new_empty(2, 8, 6), 1)
    assert (seed.kind, seed.args[1]) == ("fresh", [2, 4, 6])
    # a size-1 dim expanded across the heads: each rank expands to its own
    (seed,) = _seeds(lambda m, x: x[:, None].expand(-1, 4, -1, -1), 1)
    assert (seed.kind, seed.args[1]) == ("broadcast", [-1, 2, -1, -1])


def test_why_a_split_cannot_start():
    assert _seeds(lambda m, x: x * 2, 1) == "x is no parameter"
    assert _seeds(lambda m, x: m.buf[None, :, None] * 1.0, 1) == "b_buf is no parameter"
    assert "cannot start a split" in _seeds(lambda m, x: x.cumsum(1), 1)
    assert "not divisible by 2 ranks" in _seeds(lambda m, x: torch.zeros(3, 3), 0)


def test_a_piece_cut_along_another_dim_starts_the_split_on_what_was_cut():
    # Mamba's tensor_split of the sequence, read by the scan split by channel
    seeds = _seeds(lambda m, x: torch.tensor_split(m.w, [3], dim=1)[0], 0, w=torch.ones(8, 4))
    assert seeds == [Seed("p_w", 0, "parameter", "q_proj")]
    # an unbound slice: its dim 0 is the input's dim 1
    seeds = _seeds(lambda m, x: m.w.unbind(0)[1], 0, w=torch.ones(3, 8))
    assert seeds == [Seed("p_w", 1, "parameter", "q_proj")]
    cut = _seeds(lambda m, x: torch.tensor_split(m.w, [4], dim=0)[0], 0, w=torch.ones(8, 4))
    assert "a piece cut along it" in cut
