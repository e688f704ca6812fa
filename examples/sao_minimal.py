"""SAO in one file, in the manner of CleanRL: the tiny model, LoRA, the stale sampler, the update and the critic in
one flat loop. ``sao train --preset tiny`` runs the same experiment through the library and logs the same numbers to
float rounding (``tests/test_minimal_example.py`` holds ``sao_update`` to ``SAO.update`` and the two logs together).

    python examples/sao_minimal.py                             # 10 critic-warmup + 40 policy steps, ~1 min on 2 CPUs
    python examples/sao_minimal.py --lag 8 --correction none   # every field of Args is a flag

Written out here in the paper's notation (``sao_update``, then the loss in the loop): λ_i per row, the reversed GAE
over action tokens, the value targets, the ratio against the sampler's log-probabilities, the band mask,
c_t = f(r_t) · A_t / N, the loss; also the policy and critic steps and which adapter draws. Left to the library:
drawing tokens (``sampler.draw``: Gumbel-max on logits / T, each token's log-probability recorded with it), the
teacher-forced pass (``forward.teacher_forced``), the grader, explained variance, the tiny model and task
(``sao.tiny``). Left out (``SAO.update`` and ``Trainer`` have them): per-turn rewards, the other correction rules and
baselines, micro-batches, non-finite counts, the diagnostics this file does not log.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

import torch

from sao.algorithm.update import explained_variance
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
    gae_alpha: float = 1.5  # α in λ_i = max(0, 1 − 1/(α L_i)) (VAPO's rule; VAPO's own α is 0.05)
    ratio: tuple[float, float] = (0.7, 6.0)  # the band (lo, hi): tokens whose ratio leaves it are masked
    correction: str = "dis"  # "dis": the recipe; "none": the plain ratio, never masked
    temperature: float = 1.0
    max_new_tokens: int = 20
    train_prompts: int = 480
    test_prompts: int = 120


def parse_args(argv: list[str] | None = None) -> Args:
    """Each field of Args as a flag of its type: ``--critic-warmup 5``, ``--ratio 0.2 4.0``."""
    parser = argparse.ArgumentParser(description="SAO in one file, on the tiny model")
    for f in dataclasses.fields(Args):
        d = f.default
        kind = dict(type=type(d[0]), nargs=len(d)) if isinstance(d, tuple) else dict(type=type(d))
        parser.add_argument(f"--{f.name.replace('_', '-')}", default=d, help=f"default: {d}", **kind)
    parsed = vars(parser.parse_args(argv))
    return Args(**{name: tuple(v) if isinstance(v, list) else v for name, v in parsed.items()})


@torch.no_grad()
def sao_update(logprobs, sampler_logprobs, values, rewards, action_mask, args: Args):
    """Advantages A, value targets G and coefficients c of one batch (γ = 1, terminal rewards R_i).
    Also the ratio r and the mask of the tokens that carry gradient, for the log."""
    B, T = values.shape
    L = action_mask.sum(dim=1).to(values.dtype)  # [B] L_i: action tokens of trajectory i
    lam = (1 - 1 / (args.gae_alpha * L.clamp(min=1))).clamp(min=0)  # [B] λ_i = max(0, 1 − 1/(α L_i))
    A, G = torch.zeros_like(values), torch.zeros_like(values)  # [B, T]
    next_value, next_A, return_to_go = values.new_zeros(B), values.new_zeros(B), values.new_zeros(B)  # [B] 0 past L_i
    later_action = torch.zeros_like(action_mask[:, 0])  # [B] an action token follows t
    for t in reversed(range(T)):  # only action tokens move the bootstrap: it jumps over observation tokens
        a = action_mask[:, t]  # [B]
        r = torch.where(a & ~later_action, rewards.to(values), 0)  # [B] r_k: R_i on the last action token, else 0
        delta = r + next_value - values[:, t]  # [B] δ_k = r_k + V(a_{k+1}) − V(a_k)
        A_t = delta + lam * next_A  # [B] A_k = δ_k + λ_i A_{k+1}
        A[:, t] = torch.where(a, A_t, 0)
        next_value, next_A = torch.where(a, values[:, t], next_value), torch.where(a, A_t, next_A)
        return_to_go = return_to_go + r
        G[:, t] = return_to_go  # [B] λ_critic = 1: G_t = Σ_{k ≥ t} r_k; an observation token takes the next action's
        later_action |= a
    ratio = torch.exp(logprobs - sampler_logprobs)  # [B, T] r_t = π_θ(a_t) / π_sampler(a_t), the sampler's own record
    lo, hi = args.ratio
    f = {"dis": torch.where((lo < ratio) & (ratio < hi), ratio, 0), "none": ratio}[args.correction]  # [B, T] f(r_t)
    mask = action_mask & torch.isfinite(ratio) & torch.isfinite(A) & (f != 0)  # [B, T] tokens that carry gradient
    N = action_mask.sum()  # action tokens in the whole batch
    c = torch.where(mask, f * A, 0) / N  # [B, T] c_t = f(r_t) · A_t / N; the loss is −Σ_t c_t · log π_θ(a_t)
    return A, G, c, ratio, mask


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
    critic_opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in head.items() if not n.endswith("bias")]},
            {"params": [p for n, p in head.items() if n.endswith("bias")], "lr": args.critic_bias_lr},
        ],
        lr=args.critic_lr,
        weight_decay=0.0,
    )
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
            order = torch.Generator().manual_seed(derived_seed(args.seed, epoch, "order"))
            out.append(ids[torch.randperm(len(ids), generator=order)[i]])
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
        rollout = draw(
            policy,
            p_ids,
            p_mask,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            eos_token_ids=eos,
            pad_token_id=pad,
            generator=generator,
        )  # response_ids, action_mask, sampler_logprobs: [B, T]
        policy.set_adapter(POLICY_ADAPTER)
        for p in sampler_params.values():
            p.requires_grad_(False)
        if policy_step and args.lag > 0 and k % args.lag == 0:
            sampler_version = refresh_sampler(version)
        # --- rewards: 1 when the final answer is right; a reply cut at the token limit scores 0 -------------------
        texts = decode(tokenizer, rollout)
        graded = torch.tensor([grading.reward(text, answers[i]) for text, i in zip(texts, ids, strict=True)])
        rewards = torch.where(rollout.cut, torch.zeros_like(graded), graded)  # [B] R_i
        # --- the teacher-forced pass: log π_θ (with gradients on a policy step), hidden states for V ------------
        with torch.set_grad_enabled(policy_step):
            forward = teacher_forced(
                policy,
                rollout.prompt_ids,
                rollout.prompt_mask,
                rollout.response_ids,
                rollout.response_mask,
                temperature=args.temperature,
            )  # logprobs [B, T], hidden [B, T, H]
        with torch.no_grad():
            values = value_head(forward.hidden)  # [B, T] V(s_t)
        mask = rollout.action_mask  # [B, T]
        A, G, c, ratio, kept = sao_update(
            forward.logprobs.detach(), rollout.sampler_logprobs, values, rewards, mask, args
        )
        grad_norm = float("nan")
        if policy_step:  # loss = −Σ_t c_t · log π_θ(a_t), c held constant → clip → AdamW on the adapter
            policy_opt.zero_grad(set_to_none=True)
            loss = -(c * forward.logprobs).sum()
            if torch.isfinite(loss):
                loss.backward()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(list(theta.values()), args.grad_clip))
                if math.isfinite(grad_norm):  # a step with a non-finite loss or gradient is skipped
                    policy_opt.step()
                    version += 1
            policy_opt.zero_grad(set_to_none=True)
        # --- the critic: squared error toward G on the action tokens, on the detached hidden states -------------
        critic_loss = float("nan")
        for i in range(args.critic_steps):
            loss = torch.mean((value_head(forward.hidden)[mask] - G[mask].float()) ** 2)
            critic_loss = loss.item() if i == 0 else critic_loss  # the error the advantages were computed with
            critic_opt.zero_grad(set_to_none=True)
            loss.backward()
            critic_opt.step()
        record = {
            "step": g,
            "staleness": staleness,
            "reward_mean": float(rewards.mean()),
            "masked_share": float((mask & ~kept).sum() / mask.sum()),  # action tokens the band took out
            "ratio_max": float(ratio[mask].max()),
            "advantage_mean": float(A[mask].mean()),
            "explained_variance": explained_variance(values, G, mask),  # 1 − Var(G − V) / Var(G)
            "critic_loss": critic_loss,
            "grad_norm": grad_norm,
        }
        records.append(record)
        print(
            f"step {g:3d} {'policy' if policy_step else 'warmup'} stale {staleness} reward {record['reward_mean']:.3f} "
            f"masked {record['masked_share']:.4f} ratio_max {record['ratio_max']:.2f} "
            f"EV {record['explained_variance']:+.3f}"
        )
    return records


if __name__ == "__main__":
    main(parse_args())
