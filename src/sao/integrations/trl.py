"""sao in TRL: ``SAOConfig`` and ``SAOTrainer``, a ``GRPOTrainer`` that trains SAO at one rollout per prompt.

    rollouts   one per prompt (``num_generations=1``, which ``GRPOConfig`` refuses for GRPO's groups)
    critic     a value head V(h_t) = w · h_t + b on the trunk's last hidden state, detached, zero-initialised;
               ``critic_steps`` squared-error updates toward the return-to-go after every step, the first
               ``critic_warmup`` steps critic-only
    update     ``SAO.update``: length-adaptive GAE, the correction against the sampler's own log-probs (vLLM's when
               TRL samples with vLLM, else the policy's at generation time, the weights that sampled), c_t / N with
               N TRL's own token count of the step's batch
    metrics    sao's stats through TRL's logger as ``sao/<name>``

TRL's ``loss_type`` is a closed list, so the trainer overrides three private hooks (``HOOKS``); it refuses to start
when their signatures differ from the ones tested. Deliberately left out: ``AsyncGRPOTrainer`` (it needs a GPU), the
random control, resuming the value head from a checkpoint (``save_model`` writes it, nothing reads it back).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from trl import GRPOConfig, GRPOTrainer

from sao.core.errors import ConfigError
from sao.integrations import shared

TESTED = ("1.16", "1.17")  # TRL releases tested: >=1.16,<1.17 (1.16.0 itself; the extra pins the same range)
HOOKS = {  # the GRPOTrainer methods SAOTrainer overrides, with the parameters it was written against
    "_generate_and_score_completions": ("self", "inputs"),
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "_compute_loss": ("self", "model", "inputs"),
}
VALUE_HEAD_FILE = "value_head.pt"


@dataclass
class SAOConfig(GRPOConfig):
    """``GRPOConfig`` with SAO's settings and the protocol's defaults (one rollout per prompt, constant lr 1e-5, 256
    new tokens, temperature 1 with no top-p/top-k/min-p/repetition penalty)."""

    ratio: tuple[float, float] = field(
        default=(0.7, 6.0),
        metadata={"help": "IS band (lo, hi) of the ratio; must bracket 1. The recipe page's (0.7, 6.0)."},
    )
    correction: str = field(
        default="dis",
        metadata={"help": 'Correction rule f(ratio): "dis" (the recipe), "none" (the baseline), "tis", "seqmask".'},
    )
    tis_cap: float = field(default=2.0, metadata={"help": 'Cap C for the "tis" rule only.'})
    gae_alpha: float = field(default=1.5, metadata={"help": "λ_i = 1 − 1/(α L_i). SAO's α (VAPO used 0.05)."})
    critic_steps: int = field(default=2, metadata={"help": "Critic updates per policy update. The page's 2."})
    critic_warmup: int = field(
        default=10, metadata={"help": "Critic-only steps (each on a fresh batch) before the first policy step."}
    )
    critic_lr: float = field(default=1e-4, metadata={"help": "AdamW learning rate of the value head."})
    num_generations: int | None = field(
        default=1, metadata={"help": "Rollouts per prompt: 1 (the critic is the baseline, not a group)."}
    )
    learning_rate: float = field(default=1e-5, metadata={"help": "The initial learning rate for AdamW."})
    max_completion_length: int | None = field(default=256, metadata={"help": "Maximum new tokens per completion."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "The policy learning rate over the steps."})
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "TRL's own vLLM IS correction: off, SAO's correction replaces it."}
    )

    def __post_init__(self) -> None:
        if self.num_generations != 1:
            raise ConfigError(
                f"SAOConfig: num_generations must be 1 (one rollout per prompt), got {self.num_generations}"
            )
        if self.correction in shared.UNOFFERED_RULES:
            raise ConfigError(f"SAOConfig: correction={self.correction!r} is sao's own trainer's control only")
        neutral = {"top_p": (1.0,), "top_k": (0, -1, None), "min_p": (0.0, None), "repetition_penalty": (1.0,)}
        overrides = self.generation_kwargs if isinstance(self.generation_kwargs, dict) else {}
        for name, allowed in neutral.items():
            given = overrides.get(name, getattr(self, name))
            if given not in allowed:
                raise ConfigError(
                    f"SAOConfig: {name}={given!r} changes the distribution the sampler draws from, and the ratio "
                    f"needs it exact: leave {name}={allowed[0]!r}"
                )
        self.sao()  # SAO's own checks, one line naming the setting
        if self.per_device_train_batch_size < 2:
            raise ConfigError("SAOConfig: per_device_train_batch_size must be at least 2")
        # GRPOConfig checks that the generation batch holds whole groups of num_generations >= 2 completions. A
        # group as large as the per-device batch passes those checks (every generation batch is a multiple of it);
        # the trainer reads num_generations, which is 1 again once GRPOConfig's checks are done.
        self.num_generations_eval = self.num_generations_eval or 1
        self.num_generations = self.per_device_train_batch_size
        try:
            super().__post_init__()
        finally:
            self.num_generations = 1

    def sao(self) -> Any:
        """The algorithm these settings describe (``sao.algorithm.SAO``)."""
        from sao.algorithm.update import SAO

        return SAO(
            ratio=tuple(self.ratio),
            correction=self.correction,
            tis_cap=self.tis_cap,
            gae_alpha=self.gae_alpha,
            critic_steps=self.critic_steps,
            critic_warmup=self.critic_warmup,
        )


def check_hooks(trainer: type = GRPOTrainer) -> None:
    """Refuse, in one line, a TRL whose ``GRPOTrainer`` lacks a hook SAOTrainer overrides or takes other
    parameters than the ones it was written against."""
    import trl

    for name, expected in HOOKS.items():
        hook = getattr(trainer, name, None)
        if hook is None:
            raise ConfigError(
                f"TRL {trl.__version__}'s GRPOTrainer has no {name}; SAOTrainer was tested with TRL "
                f">={TESTED[0]},<{TESTED[1]}"
            )
        found = tuple(inspect.signature(hook).parameters)
        if found != expected:
            raise ConfigError(
                f"TRL {trl.__version__}'s GRPOTrainer.{name} takes {found}, not {expected}; SAOTrainer "
                f"was tested with TRL >={TESTED[0]},<{TESTED[1]}"
            )


class SAOTrainer(GRPOTrainer):
    """``GRPOTrainer`` training SAO: ``model``, ``reward_funcs``, ``train_dataset``, ``peft_config`` and the rest as
    TRL takes them; ``args`` an ``SAOConfig``."""

    _tag_names: ClassVar[list[str]] = ["trl", "sao"]
    _name = "SAO"

    def __init__(self, model: Any, reward_funcs: Any = None, args: SAOConfig | None = None, **kwargs: Any):
        from sao.model.policy import ValueHead
        from sao.training.learn import critic_optimizer

        check_hooks()
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = SAOConfig(f"{os.path.basename(str(name).rstrip('/'))}-SAO")
        if not isinstance(args, SAOConfig):
            raise TypeError(f"SAOTrainer needs args=SAOConfig(...), got {type(args).__name__}")
        if kwargs.get("rollout_func") is not None:
            raise ConfigError("SAOTrainer: rollout_func replaces TRL's sampler and its log-probs; SAO needs them")
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        self.sao = args.sao()
        hidden_size = self.accelerator.unwrap_model(self.model).config.get_text_config().hidden_size
        self.value_head = ValueHead(hidden_size).to(self.accelerator.device)
        self.critic_optimizer = critic_optimizer(self.value_head, args.critic_lr)
        self._rewards_per_func: torch.Tensor | None = None

    # -- the hooks -------------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = rewards_per_func  # [B_all, F] every process's rows; GRPO keeps only advantages
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        rows = output["completion_ids"].shape[0]
        start = self.accelerator.process_index * rows
        per_func = self._rewards_per_func[start : start + rows]  # [b, F] this process's rows
        if bool(torch.isinf(per_func).any()):
            row = int(torch.isinf(per_func).any(dim=1).nonzero()[0])
            raise ConfigError(f"SAOTrainer: a reward function returned an infinite reward for row {row}")
        scored = ~torch.isnan(per_func).all(dim=1)  # [b] TRL's unscorable rows (every function returned None)
        rewards = (per_func * self.reward_weights.to(per_func.device)).nansum(dim=1)  # [b] R_i
        output["sao_rewards"] = torch.where(scored, rewards, torch.zeros_like(rewards))
        output["sao_scored"] = scored
        if "sampling_per_token_logps" in output:  # vLLM's, under the distribution it drew from
            output["sampler_logprobs"] = output["sampling_per_token_logps"]
        elif self.use_vllm:
            raise ConfigError("SAOTrainer: TRL's vLLM sampler returned no log-probs, and the ratio needs them")
        else:  # the policy sampled: its log-probs now, before any update, are the sampler's
            with torch.no_grad():
                output["sampler_logprobs"] = self._policy_pass(self.model, output)[0]
        return output

    def _compute_loss(self, model, inputs):
        from sao.training.learn import critic_steps

        mode = "train" if self.model.training else "eval"
        logprobs, hidden = self._policy_pass(model, inputs)  # [b, C] with graph, [b, C, H] detached
        action = inputs["completion_mask"].bool()  # [b, C]
        if "tool_mask" in inputs:
            action = action & inputs["tool_mask"].bool()  # tool output is observation, not action
        action = action & inputs["sao_scored"][:, None]
        if not bool(action.any()):
            return (logprobs * 0.0).sum()
        with torch.no_grad():
            values = self.value_head(hidden)  # [b, C] V(s_t)
        batch = {
            "logprobs": logprobs.detach(),
            "sampler_logprobs": inputs["sampler_logprobs"],
            "values": values,
            "rewards": inputs["sao_rewards"],
            "action_mask": action,
        }
        update = self.sao.update(batch, normalizer=self._token_count(inputs, mode))
        warmup = mode == "train" and self.state.global_step < self.sao.critic_warmup
        loss = (logprobs * 0.0).sum() if warmup else update.policy_loss(logprobs)
        metrics = self._metrics[mode]
        if mode == "train":
            first = critic_steps(
                self.value_head, self.critic_optimizer, hidden, update.value_targets, action, self.sao.critic_steps
            )
            metrics["sao/critic_loss"].append(first)
            metrics["sao/critic_warmup"].append(float(warmup))
        for key, value in update.stats.items():
            metrics[f"sao/{key}"].append(value)
        return loss

    # -- helpers ---------------------------------------------------------------------------------------------

    def _policy_pass(self, model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [b, C], hidden states [b, C, H] detached) of the completion tokens under ``model``: one
        forward through the (possibly wrapped) model over prompt + completion, positions skipping left padding as
        generation does, log softmax(lm_head(h_t) / τ)[y_t] in float32 chunk by chunk (``sao.model.forward``)."""
        from sao.model.forward import position_ids_from, token_logprobs
        from sao.model.policy import causal_lm

        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        completion_mask = inputs["completion_mask"].bool()
        P, C = prompt_ids.shape[1], completion_ids.shape[1]
        ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [b, P+C]
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1).long()  # [b, P+C]
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from(mask),
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        hidden = out.hidden_states[-1][:, P - 1 : P + C - 1]  # [b, C, H] h_t predicts completion token t
        head = causal_lm(self.accelerator.unwrap_model(model)).get_output_embeddings()
        logprobs = hidden.new_zeros(completion_mask.shape, dtype=torch.float32)
        chosen = token_logprobs(head, hidden[completion_mask], completion_ids[completion_mask], self.temperature)
        return logprobs.masked_scatter(completion_mask, chosen), hidden.detach()

    def _token_count(self, inputs: dict[str, Any], mode: str) -> float:
        """N per process for this micro-batch's loss, as TRL's token-level losses count it: the generation batch's
        action tokens (every process) over the processes, rescaled to one accumulation window."""
        n = float(inputs["num_items_in_batch"].clamp(min=1.0)) / self.accelerator.num_processes
        if mode == "train":
            accumulation = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
            n = n * accumulation / self.args.steps_per_generation
        return n

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """TRL's save, and the value head beside it (``value_head.pt``)."""
        super().save_model(output_dir, _internal_call)
        if self.accelerator.is_main_process:
            folder = output_dir or self.args.output_dir
            os.makedirs(folder, exist_ok=True)
            torch.save(self.value_head.state_dict(), os.path.join(folder, VALUE_HEAD_FILE))


def _check_trl_version() -> None:
    import trl

    shared.check_version("trl", trl.__version__, TESTED)


_check_trl_version()
