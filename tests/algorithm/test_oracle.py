"""What a baseline could reach: the oracle ceiling on constructed batches, the shrunk oracle rates, the ridge probe
on representations that do and do not carry the difficulty, a fixed GAE λ, and the oracle baseline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sao.algorithm.baselines import batch_mean, oracle
from sao.algorithm.oracle import ceiling, ridge_probe, share_of, shrunk_rates
from sao.algorithm.update import SAO, gae
from sao.core.errors import ConfigError
from sao.training.learn import baseline_values


def bernoulli(p: np.ndarray, k: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((len(p), k)) < p[:, None]).astype(float)


def test_the_ceiling_of_a_constructed_batch_is_var_p_over_pbar_qbar():
    # half the prompts succeed with p 0.2, half with 0.8: Var(p) = 0.09, p̄(1 − p̄) = 0.25, the ceiling 0.36
    p = np.repeat([0.2, 0.8], 2000)
    for k in (2, 4, 16):
        got = ceiling(bernoulli(p, k, seed=k))
        assert got.prompt_level == pytest.approx(0.36, abs=0.03)
        assert got.var_prompt == pytest.approx(0.09, abs=0.01)
        assert got.mean == pytest.approx(0.5, abs=0.01)
        assert got.in_sample > got.prompt_level  # the K-sample mean fits its own noise: biased up by E[s²]/K
    assert ceiling(bernoulli(p, 2, seed=1)).in_sample == pytest.approx(0.36 + 0.16 / 2 / 0.25, abs=0.03)


def test_the_ceiling_is_zero_when_every_prompt_is_alike_and_one_when_each_decides():
    alike = ceiling(bernoulli(np.full(4000, 0.3), 8, seed=2))
    assert alike.prompt_level == pytest.approx(0.0, abs=0.02) and alike.token_level == pytest.approx(0.0, abs=0.02)
    decided = ceiling(np.repeat([[0.0] * 4, [1.0] * 4], 10, axis=0))  # each prompt always fails or always succeeds
    assert decided.prompt_level == 1.0 and decided.token_level == 1.0 and decided.var_prompt == decided.var_total


def test_the_ceiling_matches_its_formulas_row_by_row():
    rng = np.random.default_rng(3)
    returns = bernoulli(rng.uniform(0, 1, 50), 6, seed=4)
    lengths = rng.integers(1, 30, size=returns.shape).astype(float)
    got = ceiling(returns, lengths)
    p_hat, k = returns.mean(axis=1), returns.shape[1]
    total = returns.var()
    # 0/1 returns: the unbiased within-prompt variance is K/(K − 1) p̂(1 − p̂)
    assert got.prompt_level == pytest.approx(1 - np.mean(k / (k - 1) * p_hat * (1 - p_hat)) / total, rel=1e-12)
    # per token: each rollout against the token-weighted mean of the others, its squared residual shrunk by the
    # others' own noise (1 + Σ L² / (Σ L)²), weighted by its length (a slow loop)
    num = den = 0.0
    mean_w = (lengths * returns).sum() / lengths.sum()
    for i in range(returns.shape[0]):
        for j in range(k):
            rest = [m for m in range(k) if m != j]
            weights = lengths[i, rest]
            others = (weights * returns[i, rest]).sum() / weights.sum()
            noise = (weights**2).sum() / weights.sum() ** 2
            num += lengths[i, j] * (returns[i, j] - others) ** 2 / (1 + noise)
            den += lengths[i, j] * (returns[i, j] - mean_w) ** 2
    assert got.token_level == pytest.approx(1 - num / den, rel=1e-12)
    assert ceiling(returns).token_level == pytest.approx(got.prompt_level, rel=1e-12)  # equal lengths: the same
    # every prompt succeeds half the time, but on half the prompts the long rollouts are the successes: per token
    # those prompts' value is 0.8 and the others' 0.2, which a prompt-level baseline counted per token can know
    tilted = np.repeat([[1.0, 1.0, 0.0, 0.0]], 400, axis=0)
    tilted[200:] = 1 - tilted[200:]
    long_first = np.tile([40.0, 40.0, 10.0, 10.0], (400, 1))
    assert ceiling(tilted, long_first).token_level > 0.2 > 0.0 > ceiling(tilted).prompt_level


def test_the_ceiling_refuses_what_it_cannot_measure():
    for bad in ([[1.0], [0.0]], [1.0, 0.0], [[1.0, float("nan")]]):
        with pytest.raises(ConfigError):
            ceiling(bad)
    with pytest.raises(ConfigError, match="lengths"):
        ceiling([[1.0, 0.0]], [[1.0]])
    assert np.isnan(ceiling([[1.0, 1.0], [1.0, 1.0]]).prompt_level)  # nothing varies: nothing to explain
    assert share_of(0.05, 0.25) == pytest.approx(0.2) and np.isnan(share_of(0.05, 0.0))


def test_shrunk_rates_beat_the_raw_rates_and_the_batch_mean():
    rng = np.random.default_rng(5)
    for spread in (0.02, 0.1, 0.3):  # little, some, much difference between prompts
        p = np.clip(rng.normal(0.5, spread, 3000), 0, 1)
        returns = bernoulli(p, 4, seed=int(spread * 100))
        shrunk, weight = shrunk_rates(returns)
        raw = returns.mean(axis=1)
        err = lambda v, p=p: float(np.mean((v - p) ** 2))  # noqa: E731
        assert err(shrunk) <= err(raw) and err(shrunk) <= err(np.full_like(p, returns.mean())) + 1e-4
        assert 0 <= weight <= 1
    alike, weight = shrunk_rates(bernoulli(np.full(3000, 0.4), 4, seed=9))
    assert weight < 0.1 and np.ptp(alike) < 0.1  # prompts that do not differ: every rate near the mean
    assert shrunk_rates([[1.0, 0.0]])[1] == 0.0  # one prompt: nothing to tell apart


def test_the_probe_finds_a_difficulty_the_representation_carries_and_none_where_it_does_not():
    rng = np.random.default_rng(6)
    n, d = 240, 16
    features = rng.normal(size=(n, d))
    carried = 1 / (1 + np.exp(-features @ rng.normal(size=d)))  # the difficulty is a function of the features
    assert ridge_probe(features, carried)["r2"] > 0.8
    unrelated = rng.uniform(size=n)  # the difficulty is drawn apart from the features
    assert ridge_probe(features, unrelated)["r2"] < 0.05


def test_the_probe_keeps_a_prompts_tokens_out_of_the_fold_that_scores_them():
    # every token of a prompt shares its prompt's random embedding, and the target is drawn apart from it: a probe
    # that let a prompt's tokens into its own training fold would memorise the prompt and score it well
    rng = np.random.default_rng(7)
    prompts, tokens, width = 40, 12, 64  # wider than there are prompts: a linear map can memorise each one
    embedding, target = rng.normal(size=(prompts, width)), rng.uniform(size=prompts)
    groups = np.repeat(np.arange(prompts), tokens)
    features = embedding[groups] + 0.01 * rng.normal(size=(prompts * tokens, width))
    assert ridge_probe(features, target[groups])["r2"] > 0.5  # rows as the unit: the leak
    assert ridge_probe(features, target[groups], groups)["r2"] < 0.1  # prompts as the unit: nothing carried
    with pytest.raises(ConfigError, match="3 groups"):
        ridge_probe(features, target[groups], groups % 2)


def test_a_fixed_lambda_replaces_lambda_of_l_and_one_is_the_return_minus_v():
    values = torch.tensor([[0.1, 0.4, 0.2, 0.0], [0.3, 0.3, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    advantages, lam = gae(values, rewards, mask, 1.5, fixed=1.0)
    assert lam.tolist() == [1.0, 1.0]
    expected = torch.where(mask, rewards[:, None] - values, torch.zeros_like(values))  # A_k = R − V(a_k)
    assert torch.allclose(advantages, expected, atol=1e-12)
    default, lam_l = gae(values, rewards, mask, 1.5)
    assert torch.equal(gae(values, rewards, mask, 1.5, fixed=None)[0], default)
    assert lam_l.tolist() == pytest.approx([1 - 1 / 4.5, 1 - 1 / 3.0])
    assert gae(values, rewards, mask, 1.5, fixed=0.5)[1].tolist() == [0.5, 0.5]
    batch = {
        "logprobs": torch.zeros(2, 4),
        "sampler_logprobs": torch.zeros(2, 4),
        "values": values.float(),
        "rewards": rewards.float(),
        "action_mask": mask,
    }
    assert SAO(gae_lambda=1.0).update(batch).stats["lambda_mean"] == 1.0


def test_the_oracle_baseline_puts_each_rows_rate_on_its_action_tokens():
    mask = torch.tensor([[True, True, False], [False, True, True]])
    rewards = torch.tensor([1.0, 0.0])
    rates = torch.tensor([0.25, 0.75])
    values = oracle(rewards, mask, oracle_rates=rates)
    assert values.tolist() == [[0.25, 0.25, 0.0], [0.0, 0.75, 0.75]]
    with pytest.raises(ConfigError, match="oracle rate"):
        oracle(rewards, mask)
    with pytest.raises(ConfigError, match="one rate per row"):
        oracle(rewards, mask, oracle_rates=torch.tensor([0.5]))
    info = {"oracle_rates": rates, "random_key": torch.tensor([1, 2])}
    assert torch.equal(baseline_values("oracle", rewards, mask, info), values)  # given only what it names
    assert torch.equal(baseline_values("batch-mean", rewards, mask, info), batch_mean(rewards, mask))
    assert baseline_values("critic", rewards, mask, info) is None
