"""The ``tiny`` preset: the protocol's counts on the CPU stand-ins (``sao --preset tiny``).

64 prompts a step, 10 warmup + 40 policy steps, LAG 4, 3 base evals of 120 tasks × 4 samples — on the tiny model
and task. Replies are ~14 tokens, so 20 new tokens is the cap. A 0.14M-parameter model needs a larger step than a
1.5B one: at 1e-3 the reward rises ~0.16 in 40 steps on every seed measured (at 2e-3 it oscillates and falls). The
critic's weight moves at 1e-3 and its bias at 0.1 (``critic_bias_lr``): the bias carries the batch mean, so the
weight need not fit it through the hidden states' common component. With ``--env tiny-calc`` the calculator
agent's own model and task set: a call is up to 22 tokens ("<calc>9999-9999</calc>", the stop string ends it), so
20 new tokens would cut every long call; 24 leaves room to write one, and the answer ("#### 19998" + EOS) is 11.
"""

TINY = {
    "model": "tiny",
    "data": "tiny",
    "train_prompts": 480,
    "test_prompts": 120,
    "lr": 1e-3,
    "critic_lr": 1e-3,
    "critic_bias_lr": 0.1,
    "max_new_tokens": 20,
    "eval_max_new_tokens": 20,
    "micro_batch": 64,
    "by_env": {
        "tiny-calc": {"model": "tiny-calc", "data": "tiny-calc", "max_new_tokens": 24, "eval_max_new_tokens": 24}
    },
}
