"""benchmarks/scale.py part 3's search for the deepest model that fits: few runs, the exact
answer, whatever the prediction it starts from (each run of a multi-billion model takes
minutes)."""

import pytest
from conftest import benchmark


@pytest.mark.parametrize("fits_up_to", [5, 37, 89, 131])
@pytest.mark.parametrize("predicted", [5, 40, 89, 131])
def test_the_search_finds_the_deepest_fit_in_few_runs(fits_up_to, predicted, monkeypatch):
    scale = benchmark("scale", monkeypatch)
    tried = []

    def at(layers: int):
        tried.append(layers)
        return {"peak": layers} if layers <= fits_up_to else None

    cap = 131
    best = scale.deepest(at, min(predicted, cap), cap)
    assert best["layers"] == fits_up_to
    assert len(set(tried)) == len(tried)  # no depth run twice
    # away in doubling steps, then halving: logarithmic in how far the prediction was off
    assert len(tried) <= 2 * (abs(fits_up_to - predicted) + 1).bit_length() + 2


def test_the_search_says_when_nothing_fits(monkeypatch):
    scale = benchmark("scale", monkeypatch)
    with pytest.raises(RuntimeError, match="no depth from 4 layers up fits"):
        scale.deepest(lambda layers: None, 40, None)
