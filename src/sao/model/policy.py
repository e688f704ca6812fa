"""The models a run trains: a Hugging Face causal LM with a LoRA adapter (the policy) and a linear value
head on its trunk (the critic), or the paper's regime: every weight trained, a value model of its own.

    policy    base LM (hub id or local path) + LoRA rank 16, alpha 32 on every linear layer of attention
              and MLP (q, k, v, o, gate, up, down projections), built right after ``torch.manual_seed(17)``;
              ``finetune="full"``: the base itself, every weight trainable, kept in float32
    critic    V(s_t) = w · h_t + b on the trunk's last hidden state h_t, zero-initialised, reading
              ``h.detach()`` so that the critic never trains the trunk; ``critic="model"``: the same head on a
              trunk of its own (``ValueModel``), which the critic loss trains (its own LoRA, or every weight)
    Models    the parts together with the tokenizer, the token ids that end a reply, the stale sampler's
              frozen copy under full fine-tuning, and the FSDP roots once sharded (``sao.model.sharding``)

The pass that feeds both is ``sao.model.forward``; saving and merging adapters is ``sao.model.artifacts``.
Deliberately left out: quantisation and tensor parallelism; the fast GPU decoder lives in ``sao.rollout.engine``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sao.core import hub
from sao.core.errors import ConfigError
from sao.core.machine import on_terminal, quiet_libraries
from sao.core.registry import MODELS

# Every linear layer of a Qwen2/Llama-style block; the ones a model lacks are skipped.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
POLICY_ADAPTER = "default"
SAMPLER_ADAPTER = "sampler"  # the stale sampler's frozen copy of the policy adapter (``sao.rollout.sampler``)


def pick_device(device: str | None = None) -> torch.device:
    """``None``/"auto" → CUDA when available, else CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise ConfigError(f"--device {device!r} is not a device torch knows ({error})") from None


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU, float32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def model_path(name: str | os.PathLike[str]) -> str:
    """The folder or hub id a model name stands for: a registered stand-in ("tiny", "tiny-calc": ``MODELS`` in
    ``sao.core.registry``) is built and cached on first use; any other name is a hub id or folder as it is."""
    name = os.fspath(name)
    return str(MODELS.get(name)()) if name in MODELS else name


def load_base(model: str | os.PathLike[str], device: torch.device, dtype: torch.dtype | None = None):
    """Load a causal LM and its tokenizer by name (``model_path``): hub id, local directory or stand-in. Returns
    (model, tokenizer).

    The tokenizer pads on the left (batched prompts end where the response begins) and falls back to
    its EOS token for padding when it has no pad token. A model with no EOS token at all (neither its tokenizer
    nor its generation config names one) is refused: none of its replies could end.
    """
    name = model_path(model)
    path, local = locate(name)
    if not local:
        check_hub_reachable(name)  # before transformers is imported (seconds): a missing hub id is said at once
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or default_dtype(device)
    if not on_terminal():
        quiet_libraries()  # transformers' weight-loading bar draws with \r: kept out of a log file
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"could not load model {name!r}: {first} (no network? pass a local directory with --model)"
        ) from None
    tokenizer.padding_side = "left"
    ends = eos_ids(tokenizer, lm)
    if not ends:  # no reply could end before the token limit: every one cut, every reward the cut-off one
        raise ConfigError(
            f"model {name!r}: its tokenizer has no EOS token and its generation config names none, so "
            "no reply could end before the token limit; set eos_token in its tokenizer_config.json "
            "(or eos_token_id in generation_config.json)"
        )
    if tokenizer.pad_token_id is None:  # padding is masked out: any token that ends a reply will do
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(ends[0])
    lm.to(device)
    lm.eval()  # no dropout anywhere: the sampler and the teacher-forced pass must see the same function
    lm.generation_config.pad_token_id = tokenizer.pad_token_id
    return lm, tokenizer


def locate(model: str | os.PathLike[str]) -> tuple[str, bool]:
    """(the folder or hub id ``model`` stands for, whether it is a folder here): a name that reads as a path (it
    starts with /, . or ~, has more than one /, or is an existing file) and is no folder is a one-line ConfigError,
    before anything loads."""
    name = model_path(model)
    path = os.path.expanduser(name)
    if not os.path.isdir(path) and (name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.path.exists(path)):
        raise ConfigError(f"model path {name!r} is not a directory; pass a hub id or a save_pretrained directory")
    return (path, True) if os.path.isdir(path) else (name, False)


def check_hub_reachable(hub_id: str) -> None:
    """Nothing when ``hub_id`` is in the local hub cache or the hub answers a connection within
    ``HUB_PROBE_SECONDS``; otherwise a one-line ConfigError now, instead of the hub client's retries (tens of
    seconds) when ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` is set or the hub cannot be reached
    (``sao.core.hub``)."""
    hub.check_reachable(
        hub_id, kind="model", fix="pass a local directory with --model, or --preset tiny for the CPU stand-in"
    )


def add_lora(model: nn.Module, rank: int = 16, alpha: int = 32, seed: int = 17, dropout: float = 0.0):
    """Wrap ``model`` with a trainable LoRA adapter; every base weight is frozen.

    ``torch.manual_seed(seed)`` runs right before the adapter is built, so the adapter's init depends on the
    seed alone. Dropout is 0 by default: with dropout the teacher-forced pass would not be the function
    the sampler drew from.
    """
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    targets = [t for t in LORA_TARGETS if t in names]
    if not targets:
        raise ConfigError(f"the model has none of the LoRA target layers {list(LORA_TARGETS)}")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none")
    torch.manual_seed(seed)
    policy = get_peft_model(model, config)
    policy.eval()
    return policy


def causal_lm(model: nn.Module) -> nn.Module:
    """The underlying *ForCausalLM, through a PEFT wrapper if there is one."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def eos_ids(tokenizer, model: nn.Module | None = None) -> list[int]:
    """Every token that ends a reply: the tokenizer's EOS and the model's generation-config EOS ids."""
    ids = {tokenizer.eos_token_id}
    config = getattr(model, "generation_config", None) if model is not None else None
    extra = getattr(config, "eos_token_id", None)
    ids.update(extra if isinstance(extra, list) else [extra])
    return sorted(i for i in ids if i is not None)


def context_length(model: Any) -> int | None:
    """The most positions ``model`` (or its ``config``) attends over, prompt and reply together: its
    ``max_position_embeddings`` (or ``n_positions``); None when its config states neither."""
    config = getattr(model, "config", model)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def lora_state(policy: nn.Module, adapter: str = POLICY_ADAPTER) -> dict[str, torch.Tensor]:
    """The adapter's LoRA tensors by parameter name (references, not copies)."""
    marker = f".{adapter}."
    return {n: p for n, p in policy.named_parameters() if "lora_" in n and marker in n}


def trainable_state(model: nn.Module, finetune: str) -> dict[str, torch.Tensor]:
    """What an optimizer trains in ``model``, by parameter name (references): the policy adapter's LoRA tensors
    ("lora"), or every parameter once ("full"; a tied embedding and head are one parameter)."""
    if finetune == "lora":
        return lora_state(model)
    return dict(model.named_parameters())


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Recompute each decoder layer in the backward instead of storing its activations.

    Hugging Face only checkpoints layers whose ``training`` flag is set, and the policy runs in eval mode
    (no dropout: the teacher-forced pass must be the function the sampler drew from). So the flag is set on
    the decoder layers alone, not recursively: their dropout children stay in eval mode."""
    lm = causal_lm(model)
    kwargs = {"use_reentrant": False}
    if hasattr(lm, "activation_checkpointing_enable"):  # the newer name for the same switch
        lm.activation_checkpointing_enable(kwargs) if enabled else lm.activation_checkpointing_disable()
    elif enabled:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_disable()
    for layer in lm.get_decoder().layers:
        layer.training = enabled


class ValueHead(nn.Module):
    """V(h) = w · h + b, zero-initialised: the critic starts at V ≡ 0 and learns from the MC returns."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] hidden states (any dtype) → [...] float32 values."""
        return self.linear(hidden.float()).squeeze(-1)


class ValueModel(nn.Module):
    """``critic="model"``: V(s_t) = w · h_t + b on a trunk of its own, whose hidden states are not detached, so the
    critic loss trains the trunk (its LoRA adapter, or every weight). h_t is taken where the policy's pass takes
    it (the position that predicts response token t), so V(h_t) is the value of the state the token was chosen in."""

    def __init__(self, trunk: nn.Module, hidden_size: int):
        super().__init__()
        self.trunk, self.head = trunk, ValueHead(hidden_size)

    def forward(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        """[B, P] left-padded prompts and [B, R] right-padded responses → [B, R] float32 values."""
        P, R = prompt_ids.shape[1], response_ids.shape[1]
        ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, P+R]
        mask = torch.cat([prompt_mask, response_mask], dim=1).long()  # [B, P+R]
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)  # skip left padding, as the policy's pass does
        out = self.trunk(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        return self.head(out.last_hidden_state[:, P - 1 : P + R - 1])  # [B, R]


def load_value_model(
    name: str,
    device: torch.device,
    tokenizer: Any,
    *,
    finetune: str,
    lora_rank: int,
    lora_alpha: int,
    seed: int,
    dtype: torch.dtype | None = None,
) -> ValueModel:
    """The value model of ``critic="model"``: the trunk of the causal LM ``name`` (its head is dropped), with a LoRA
    adapter built after ``torch.manual_seed(seed)`` ("lora") or every weight trainable ("full"), and a zero head.
    Its tokenizer must be ``tokenizer`` (it reads the policy's token ids): another vocabulary is a ConfigError."""
    lm, own = load_base(name, device, dtype)
    if own.get_vocab() != tokenizer.get_vocab():
        theirs, ours = len(own.get_vocab()), len(tokenizer.get_vocab())
        raise ConfigError(
            f"--critic-model {name}: its tokenizer is not the policy's ({theirs} tokens against "
            f"{ours}, or the same count with other ids); the value model reads the policy's tokens, so "
            "it needs the same vocabulary"
        )
    trunk = causal_lm(lm).get_decoder()
    if finetune == "lora":
        from peft import LoraConfig, get_peft_model

        names = {n.rsplit(".", 1)[-1] for n, m in trunk.named_modules() if isinstance(m, nn.Linear)}
        config = LoraConfig(
            r=lora_rank,
            lora_alpha=lora_alpha,
            lora_dropout=0.0,
            bias="none",
            target_modules=[t for t in LORA_TARGETS if t in names],
        )
        torch.manual_seed(seed)
        trunk = get_peft_model(trunk, config)
    else:
        trunk.requires_grad_(True)
    model = ValueModel(trunk, lm.config.hidden_size).to(device)
    model.eval()  # no dropout: the values a step's advantages use are the ones the first critic update scores
    return model


def critic_trainable(critic: ValueModel, finetune: str) -> dict[str, torch.Tensor]:
    """What the critic's optimizer trains in a value model: its LoRA tensors or every trunk weight, and the head."""
    trunk = {f"trunk.{n}": p for n, p in trainable_state(critic.trunk, finetune).items()}
    return {**trunk, **{f"head.{n}": p for n, p in critic.head.named_parameters()}}


@dataclass
class Models:
    """What a run trains: the policy (base + LoRA, or every weight), its tokenizer, and the critic (a value head on
    the policy's trunk, or a ``ValueModel`` of its own), on one device."""

    policy: nn.Module
    tokenizer: Any
    value_head: ValueHead | None  # the critic head on the policy's trunk; None with a value model
    device: torch.device
    eos_token_ids: list[int]
    name: str = ""  # the base model's hub id or folder, as loaded
    finetune: str = "lora"  # what the policy trains: "lora" or "full"
    critic: ValueModel | None = None  # critic="model": the value model (its own trunk and head)
    critic_name: str = ""  # the value model's base, as loaded
    sampler: nn.Module | None = None  # finetune="full": the stale sampler's frozen copy of the policy
    roots: dict[str, nn.Module] = field(default_factory=dict)  # once sharded: "policy", "sampler", "critic" roots

    @classmethod
    def load(
        cls,
        name: str,
        *,
        device: str = "auto",
        lora_rank: int = 16,
        lora_alpha: int = 32,
        seed: int = 17,
        grad_checkpoint: bool = False,
        finetune: str = "lora",
        critic: str = "head",
        critic_model: str | None = None,
        master_float32: bool = False,
    ) -> Models:
        """Base model and tokenizer by ``name`` (hub id, folder or stand-in: ``model_path``), a fresh LoRA adapter
        (seeded) or every weight trainable, and a zero value head: on the policy's trunk, or on a value model of
        its own (``critic="model"``: ``critic_model`` or the policy's base). ``master_float32``: load in float32
        even on a GPU (sharding computes in bf16 from float32 weights); full fine-tuning always does (an AdamW step at
        lr 1e-6 is below bf16's resolution)."""
        torch_device = pick_device(device)
        path = model_path(name)
        dtype = torch.float32 if master_float32 or finetune == "full" else None
        base, tokenizer = load_base(path, torch_device, dtype)
        if finetune == "lora":
            policy = add_lora(base, rank=lora_rank, alpha=lora_alpha, seed=seed)
        else:
            policy = base.requires_grad_(True)
        if grad_checkpoint:
            set_activation_checkpointing(policy, True)
        value_head, value_model, critic_path = None, None, ""
        if critic == "model":
            critic_path = model_path(critic_model) if critic_model is not None else path
            value_model = load_value_model(
                critic_path,
                torch_device,
                tokenizer,
                finetune=finetune,
                lora_rank=lora_rank,
                lora_alpha=lora_alpha,
                seed=seed,
                dtype=dtype,
            )
            if grad_checkpoint:
                set_activation_checkpointing(value_model.trunk, True)
        else:
            value_head = ValueHead(base.config.hidden_size).to(torch_device)
        return cls(
            policy,
            tokenizer,
            value_head,
            torch_device,
            eos_ids(tokenizer, base),
            path,
            finetune=finetune,
            critic=value_model,
            critic_name=critic_path,
        )

    # -- what trains ---------------------------------------------------------------------------------------------

    def trainable(self) -> dict[str, torch.Tensor]:
        """The policy's trained parameters by name (``trainable_state``)."""
        return trainable_state(self.policy, self.finetune)

    def critic_trainable(self) -> dict[str, torch.Tensor]:
        """The critic's trained parameters by name: the value head's, or the value model's (``critic_trainable``)."""
        if self.critic is None:
            assert self.value_head is not None
            return dict(self.value_head.named_parameters())
        return critic_trainable(self.critic, self.finetune)

    def add_stale_sampler(self) -> None:
        """Make room for the stale sampler before the models are sharded: a second LoRA adapter ("sampler"), or
        under full fine-tuning a frozen copy of the whole policy (one more copy of the weights)."""
        if self.finetune == "full":
            if self.sampler is None:
                self.sampler = copy.deepcopy(self.policy).requires_grad_(False)
        elif SAMPLER_ADAPTER not in self.policy.peft_config:
            self.policy.add_adapter(SAMPLER_ADAPTER, self.policy.peft_config[POLICY_ADAPTER])
            self.policy.set_adapter(POLICY_ADAPTER)
            for p in lora_state(self.policy, SAMPLER_ADAPTER).values():
                p.requires_grad_(False)

    # -- sharding --------------------------------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        return bool(self.roots)

    def shard(self) -> None:
        """FSDP2 over the process group (``sao.model.sharding.shard``): the policy, the stale sampler's copy and the
        value model each get a root; the value head on the policy's trunk stays whole on every process (its
        gradients are summed, as in data parallel: H + 1 numbers)."""
        from sao.model.sharding import shard

        self.roots["policy"] = shard(self.policy, self.device)
        if self.sampler is not None:
            self.roots["sampler"] = shard(self.sampler, self.device)
        if self.critic is not None:
            self.roots["critic"] = shard(self.critic, self.device)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, through the policy's FSDP root when sharded (every process must call it)."""
        root = self.roots.get("policy")
        return fn(*args, **kwargs) if root is None else root(fn, *args, **kwargs)

    def values(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        """The value model's [b, R] values (``critic="model"``), through its FSDP root when sharded."""
        assert self.critic is not None
        root = self.roots.get("critic")
        args = (prompt_ids, prompt_mask, response_ids, response_mask)
        return self.critic(*args) if root is None else root(self.critic, *args)


def parameter_count(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def describe(model: Any) -> str:
    """One line: parameter counts and dtype."""
    total, trainable = parameter_count(model), parameter_count(model, trainable_only=True)
    dtype = next(model.parameters()).dtype
    return f"{total / 1e6:.2f}M parameters ({trainable / 1e6:.3f}M trainable), {str(dtype).removeprefix('torch.')}"
