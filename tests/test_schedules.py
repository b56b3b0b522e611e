"""Schedule functions of u (paper section 3 eq. exp-decay, appendix C) and the plan's per-row curriculum."""
import numpy as np
import pytest

from common.config import ConfigError, GenerateConfig
from common.curriculum import row_fraction, strength_at
from tests.conftest import temperature_at
from common.plan import epoch_curriculum, plan_tasks

U = np.linspace(0.0, 1.0, 1001)


@pytest.mark.parametrize("gamma_max", [1.0, 0.35])
def test_each_schedule_hits_its_end_points(gamma_max):
    assert strength_at(np.array([0.0, 1.0]), "exponential", gamma_max, 0.1).tolist() == \
        [gamma_max, gamma_max * np.exp(-10.0)]
    assert strength_at(np.array([0.0, 1.0]), "constant", gamma_max, 0.1).tolist() == [gamma_max, gamma_max]
    for tau in (0.5, 1.0, 9.0):
        assert strength_at(np.array([0.0, 1.0]), "polynomial", gamma_max, tau).tolist() == [gamma_max, 0.0]
    for steps in (1, 4, 10):
        assert strength_at(np.array([0.0, 1.0]), "stepwise", gamma_max, steps).tolist() == [gamma_max, 0.0]


@pytest.mark.parametrize("schedule,tau", [("exponential", 0.1), ("constant", 0.1), ("polynomial", 3.0), ("stepwise", 4)])
def test_schedules_never_increase_and_stay_in_range(schedule, tau):
    g = strength_at(U, schedule, 0.8, tau)
    assert g.dtype == np.float64 and g.shape == U.shape
    assert np.all(np.diff(g) <= 0) and g.min() >= 0 and g.max() <= 0.8


def test_polynomial_and_stepwise_follow_their_formulas():
    assert strength_at(np.array([0.5]), "polynomial", 1.0, 2.0)[0] == 0.25       # (1 - 0.5)^2
    g = strength_at(U, "stepwise", 1.0, 4)
    assert sorted(set(g.tolist())) == [0.0, 0.25, 0.5, 0.75, 1.0]               # tau = 4 decays
    assert strength_at(np.array([0.24, 0.25, 0.74, 0.75]), "stepwise", 1.0, 4).tolist() == [1.0, 0.75, 0.5, 0.25]


def test_temperature_scaling_plan_is_the_paper_equation_bitwise():
    """T = 1 + gamma(u), gamma_max = T0 - 1: the default equals temperature_at exactly (shards unchanged)."""
    cfg = GenerateConfig(t0=2.0, tau=0.1)
    stream = np.arange(0, 300, 7)
    temps, gammas = epoch_curriculum(cfg, 0, stream, 300)
    assert np.array_equal(temps, temperature_at(row_fraction(stream, 300), 2.0, 0.1))
    assert np.allclose(gammas, temps - 1.0, rtol=0, atol=1e-15)
    poly = GenerateConfig(t0=3.0, tau=2.0, schedule="polynomial")
    assert np.allclose(epoch_curriculum(poly, 0, stream, 300)[0], 1.0 + 2.0 * (1 - stream / 300) ** 2)
    fixed = GenerateConfig(t0=1.0, schedule="constant")
    assert np.all(epoch_curriculum(fixed, 0, stream, 300)[0] == 1.0)


def test_other_curricula_schedule_gamma_at_temperature_one():
    cfg = GenerateConfig(epochs=2, rows_per_shard=16, valid_rows=10, augmentation="dropout", gamma_max=0.3,
                         schedule="stepwise", tau=2)
    tasks = plan_tasks(num_train_rows=40, num_valid_rows=10, cfg=cfg, seed=1)
    train = [t for t in tasks if t.split == "train"]
    assert all((t.temperatures == 1.0).all() for t in train)
    gammas = np.concatenate([t.gammas for t in train])
    assert gammas[0] == 0.3 and set(gammas.tolist()) == {0.3, 0.15}  # u < 1 for every row
    valid = [t for t in tasks if t.split == "valid"]
    assert all(t.gammas is None and (t.temperatures == 1.0).all() for t in valid)  # the aux model at T = 1
    none = GenerateConfig(distribution="smoothed_one_hot")
    temps, gammas = epoch_curriculum(none, 0, np.arange(4), 4)
    assert (temps == 1.0).all() and (gammas == 0.0).all()


def test_curriculum_settings_are_validated():
    with pytest.raises(ConfigError, match="schedule must be one of"):
        GenerateConfig(schedule="cosine")
    with pytest.raises(ConfigError, match="needs distribution = 'aux'"):
        GenerateConfig(distribution="uniform", augmentation="drop_token")
    with pytest.raises(ConfigError, match="must be < 1"):
        GenerateConfig(augmentation="attention_dropout", gamma_max=1.0)
    with pytest.raises(ConfigError, match="whole number"):
        GenerateConfig(schedule="stepwise", tau=2.5)
    with pytest.raises(ConfigError, match="soh_alpha"):
        GenerateConfig(soh_alpha=1.0)
    with pytest.raises(ConfigError, match="gamma_max"):
        GenerateConfig(distribution="tf_to_soh", gamma_max=1.5)
