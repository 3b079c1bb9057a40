"""fp16 loss scaling: a streak of skipped steps is not silent."""

import warnings

import pytest

from fxstar.plan import LossScaleConfig
from fxstar.runtime.loss_scale import LossScaler


def _overflows(scaler: LossScaler, n: int) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            scaler.update(overflow=True)
    return caught


def test_a_streak_of_skips_warns_once_and_again_after_a_clean_step():
    scaler = LossScaler.from_config(LossScaleConfig(initial_scale_power=4, warn_after_skips=3))
    assert _overflows(scaler, 2) == []
    caught = _overflows(scaler, 5)  # the streak reaches 3 once, then goes on quietly
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    message = str(caught[0].message)
    assert "last 3 optimizer steps were all skipped" in message
    assert "loss scale is 8 (min_loss_scale 1)" in message and "warn_after_skips" in message
    scaler.update(overflow=False)
    assert len(_overflows(scaler, 3)) == 1
    assert scaler.skipped_steps == 10


@pytest.mark.parametrize("config", [LossScaleConfig(loss_scale=128), LossScaleConfig()])
def test_default_is_ten_and_fixed_scales_warn_too(config):
    scaler = LossScaler.from_config(config)
    assert _overflows(scaler, 9) == []
    assert len(_overflows(scaler, 1)) == 1


def test_zero_never_warns():
    scaler = LossScaler.from_config(LossScaleConfig(warn_after_skips=0))
    assert _overflows(scaler, 50) == []
