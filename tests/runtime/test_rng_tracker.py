"""The rank streams outside a training run: a run that measures or checks a graph (compile's
shape_memory on real tensors, verify) leaves every generator the training run draws from as
it was, the rank streams of the graph's process groups included."""

import torch

from fxstar.runtime import rng_tracker
from fxstar.runtime.rank_group import RankGroup


def _graph_with_stream(seed: int) -> tuple[torch.nn.Module, rng_tracker.RankStream]:
    group = RankGroup(None, None)  # no process group: only its stream is used here
    group.stream = rng_tracker.RankStream(seed)
    graph = torch.nn.Module()
    graph.region = torch.nn.Module()
    graph.region.tp_group = group
    return graph, group.stream


def _draw(stream: rng_tracker.RankStream) -> torch.Tensor:
    with stream.fork(torch.device("cpu")):
        return torch.rand(8)


def test_fork_all_leaves_the_rank_streams_and_the_default_generator_as_they_were():
    graph, stream = _graph_with_stream(5)
    assert rng_tracker.streams_of(graph) == [stream]
    torch.manual_seed(1)
    with rng_tracker.fork_all(graph):
        inside = _draw(stream), torch.rand(8)
    after = _draw(stream), torch.rand(8)
    assert torch.equal(inside[0], after[0]) and torch.equal(inside[1], after[1])
    # without it the measuring run's draws move the stream on
    _draw(stream)
    assert not torch.equal(_draw(stream), after[0])
