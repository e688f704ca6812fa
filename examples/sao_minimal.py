"""SAO in one file, in the manner of CleanRL: the tiny model, LoRA, the stale sampler, ``SAO.update`` and the
critic's steps in one flat loop. ``sao train --preset tiny`` runs the same experiment through the library and,
with the same settings, logs the same numbers (``tests/test_minimal_example.py`` holds the two together).

    python examples/sao_minimal.py            # 10 critic-warmup steps + 40 policy steps on a 2-core CPU, ~1 min

What it leaves to the library: sampling one token (``sampler.draw``: Gumbel-max on logits / T, the drawn token's
log-probability recorded with it), the teacher-forced pass (``forward.teacher_forced``), the grader, and the tiny
model and task (``sao.tiny``). Everything that makes the method — which adapter draws, how stale it is, the update,
the loss, the critic — is written out here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sao import SAO
from sao.model.forward import teacher_forced
from sao.model.policy import POLICY_ADAPTER, ValueHead, add_lora, eos_ids, load_base, lora_state
from sao.rollout.sampler import decode, derived_seed, draw, encode_prompts
from sao.tasks.gsm8k import format_prompt, grading
from sao.tiny import arithmetic


@dataclass
class Args:
    """The tiny preset's protocol: the page's counts on the CPU stand-in."""

    seed: int = 17  # set right before the adapter is built; the root of every other random stream
    steps: int = 40  # policy steps after the critic warmup
    critic_warmup: int = 10  # critic-only steps, each on a fresh batch
    batch_size: int = 64  # prompts per step, one rollout each
    lag: int = 4  # the sampler's adapter is refreshed every LAG policy steps
    lr: float = 1e-3  # AdamW on the LoRA adapter (the 1.5B protocol uses 1e-5)
    critic_lr: float = 1e-3  # AdamW on the value head's weight
    critic_bias_lr: float = 0.1  # ... and on its bias, which carries the batch mean (docs/design/learn.md)
    critic_steps: int = 2  # squared-error updates of the value head per step
    grad_clip: float = 1.0
    ratio: tuple[float, float] = (0.7, 6.0)  # the band: tokens whose ratio leaves it are masked
    correction: str = "dis"  # "dis": the recipe; "none": the plain ratio, never masked
    temperature: float = 1.0
    max_new_tokens: int = 20
    train_prompts: int = 480
    test_prompts: int = 120


def main(args: Args | None = None) -> list[dict]:
    args = args or Args()
    torch.set_num_threads(1)  # the tiny model's operations are too small to split
    # --- the task and the models ------------------------------------------------------------------------------
    tasks = arithmetic.make_split(args.train_prompts, args.test_prompts, seed=0).train
    model, tokenizer = load_base("tiny", torch.device("cpu"))
    policy = add_lora(model, rank=16, alpha=32, seed=args.seed)  # the policy's adapter: "default"
    policy.add_adapter("sampler", policy.peft_config[POLICY_ADAPTER])  # the stale sampler: a second adapter
    policy.set_adapter(POLICY_ADAPTER)
    theta = lora_state(policy, POLICY_ADAPTER)  # the trained tensors, by name
    sampler_params = lora_state(policy, "sampler")
    pairs = [(p, sampler_params[n.replace(f".{POLICY_ADAPTER}.", ".sampler.")]) for n, p in theta.items()]
    value_head = ValueHead(model.config.hidden_size)  # V(h) = w·h + b, zero at the start
    policy_opt = torch.optim.AdamW(list(theta.values()), lr=args.lr, weight_decay=0.0)
    head = dict(value_head.named_parameters())  # the weight at critic_lr, the bias at critic_bias_lr
    critic_opt = torch.optim.AdamW([{"params": [p for n, p in head.items() if not n.endswith("bias")]},
                                    {"params": [p for n, p in head.items() if n.endswith("bias")],
                                     "lr": args.critic_bias_lr}], lr=args.critic_lr, weight_decay=0.0)  # fmt: skip
    sao = SAO(ratio=args.ratio, correction=args.correction, critic_steps=args.critic_steps,
              critic_warmup=args.critic_warmup)  # fmt: skip
    eos, pad = eos_ids(tokenizer, model), tokenizer.pad_token_id
    prompts = {t.id: format_prompt(tokenizer, t.question, arithmetic.TINY_INSTRUCTION) for t in tasks}
    answers = {t.id: t.answer for t in tasks}

    def refresh_sampler(version: int) -> int:  # copy the policy's adapter into the sampler's, frozen
        with torch.no_grad():
            for p, q in pairs:
                q.copy_(p)
                q.requires_grad_(False)
        return version

    def prompt_ids(step: int) -> list[str]:  # epoch e reads the prompts through its own seeded permutation
        ids, out = list(prompts), []
        for position in range(step * args.batch_size, (step + 1) * args.batch_size):
            epoch, i = divmod(position, len(ids))
            perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(derived_seed(args.seed, epoch,
                                                                                                 "order")))  # fmt: skip
            out.append(ids[perm[i]])
        return out

    version, sampler_version, records = 0, refresh_sampler(0), []
    for g in range(args.critic_warmup + args.steps):
        policy_step = g >= args.critic_warmup
        k = g - args.critic_warmup
        # --- the stale sampler: LAG 0 refreshes before every draw; else after drawing step k when k % LAG == 0
        if policy_step and args.lag == 0:
            sampler_version = refresh_sampler(version)
        staleness = version - sampler_version
        ids = prompt_ids(g)
        generator = torch.Generator().manual_seed(derived_seed(args.seed, g, "rollout"))
        p_ids, p_mask = encode_prompts(tokenizer, [prompts[i] for i in ids], torch.device("cpu"))  # [B, P]
        policy.set_adapter("sampler", inference_mode=True)
        rollout = draw(policy, p_ids, p_mask, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       eos_token_ids=eos, pad_token_id=pad, generator=generator)  # fmt: skip
        policy.set_adapter(POLICY_ADAPTER)
        for p in sampler_params.values():
            p.requires_grad_(False)
        if policy_step and args.lag > 0 and k % args.lag == 0:
            sampler_version = refresh_sampler(version)
        # --- rewards: 1 when the final answer is right; a reply cut at the token limit scores 0 -------------------
        texts = decode(tokenizer, rollout)
        graded = torch.tensor([grading.reward(text, answers[i]) for text, i in zip(texts, ids, strict=True)])
        rewards = torch.where(rollout.cut, torch.zeros_like(graded), graded)  # [B]
        # --- the teacher-forced pass: log-probs now (with gradients on a policy step), hidden states for V -----
        with torch.set_grad_enabled(policy_step):
            forward = teacher_forced(policy, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                     rollout.response_mask, temperature=args.temperature)  # fmt: skip
        with torch.no_grad():
            values = value_head(forward.hidden)  # [B, R]
        batch = {"logprobs": forward.logprobs.detach(), "sampler_logprobs": rollout.sampler_logprobs,
                 "values": values, "rewards": rewards, "action_mask": rollout.action_mask}  # fmt: skip
        update = sao.update(batch)  # GAE advantages, value targets, c_t = f(r_t) · A_t / N, diagnostics
        grad_norm = float("nan")
        if policy_step:  # loss = −Σ c·logprobs, c held constant → clip → AdamW on the adapter
            policy_opt.zero_grad(set_to_none=True)
            loss = update.policy_loss(forward.logprobs)
            if torch.isfinite(loss):
                loss.backward()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(list(theta.values()), args.grad_clip))
                if math.isfinite(grad_norm):
                    policy_opt.step()
                    version += 1
            policy_opt.zero_grad(set_to_none=True)
        # --- the critic: squared error toward the Monte Carlo returns, on the detached hidden states ------------
        mask = rollout.action_mask
        critic_loss = float("nan")
        for i in range(args.critic_steps):
            loss = torch.mean((value_head(forward.hidden)[mask] - update.value_targets[mask].float()) ** 2)
            critic_loss = loss.item() if i == 0 else critic_loss  # the error the advantages were computed with
            critic_opt.zero_grad(set_to_none=True)
            loss.backward()
            critic_opt.step()
        s = update.stats
        records.append({"step": g, "staleness": staleness, "reward_mean": float(rewards.mean()),
                        "masked_share": s["masked_share"], "ratio_max": s["ratio_max"],
                        "explained_variance": s["explained_variance"], "critic_loss": critic_loss,
                        "grad_norm": grad_norm})  # fmt: skip
        print(
            f"step {g:3d} {'policy' if policy_step else 'warmup'} stale {staleness} reward {rewards.mean():.3f} "
            f"masked {s['masked_share']:.4f} ratio_max {s['ratio_max']:.2f} EV {s['explained_variance']:+.3f}"
        )
    return records


if __name__ == "__main__":
    main()
