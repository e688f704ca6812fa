"""tinker-cookbook's capture, read by ``sao train --traces``: the ``capture/sample.jsonl`` lines its JSONL sink writes.

A ``kind: "sample"`` record is one ``SamplingClient.sample`` call: ``scope`` (run_id, iteration, ...),
``prompt_tokens``, ``sampling_params`` (max_tokens, temperature, top_p, top_k, seed), ``model_path`` (the sampler
checkpoint; absent for the base model) or ``base_model``, ``sampling_session_id`` and ``seq_id``, and ``samples``: per
sampled sequence its ``tokens``, ``logprobs`` and ``stop_reason``. Each sample becomes one sao trajectory, with the id
``"{sampling_session_id}:{seq_id}:{sample index}"`` (the capture store's own key). The capture records no reward:
give one per id as a sao feedback line (in the same log or another file of the folder). Lines of other kinds
(``train_op``) and failed calls hold no trajectory: counted, not used.

Refused in one line: a sample without log-probs, no recorded temperature, top_p/top_k that truncate the
distribution, and a sample from a Tinker checkpoint (``model_path``) unless the scope names its sao
``policy_version``: sao trains the model it starts from (version 0) and its own published versions, and cannot place
another system's checkpoint among them.
"""

from __future__ import annotations

from typing import Any

from sao.rollout.traces import BadRecord, Tokens, line_id, sampled_temperature, sampler_logprobs

STOP_REASONS = {"length": "length", "stop": "stop"}  # tinker's StopReason → finish_reason


class TinkerCapture:
    """The tinker-cookbook capture format (a ``TraceFormat``)."""

    name = "tinker"

    def detect(self, record: dict[str, Any]) -> bool:
        return isinstance(record.get("kind"), str) and isinstance(record.get("scope"), dict)

    def records(self, record: dict[str, Any], tokens: Tokens, where: str) -> list[dict[str, Any]]:
        samples = record.get("samples")
        if record["kind"] != "sample" or record.get("status") == "error" or not samples:
            return []  # a training call, or a sample call that failed: no trajectory
        if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
            raise BadRecord("samples", "must be a list of {tokens, logprobs, stop_reason}")
        prompt = record.get("prompt_tokens")
        if not isinstance(prompt, list) or not prompt:
            raise BadRecord("prompt_tokens", "missing: the capture could not record the prompt as tokens")
        temperature = sampled_temperature(record.get("sampling_params"), "sampling_params")
        version = _version(record)
        session, seq = record.get("sampling_session_id"), record.get("seq_id")
        base = f"{session}:{seq}" if seq is not None else line_id(where)
        out = []
        for i, sample in enumerate(samples):
            ids = sample.get("tokens")
            if not isinstance(ids, list):
                raise BadRecord(f"samples[{i}].tokens", "must be the list of sampled token ids")
            reason = sample.get("stop_reason")
            trace: dict[str, Any] = {
                "id": f"{base}:{i}",
                "policy_version": version,
                "temperature": temperature,
                "prompt_token_ids": prompt,
                "completion_token_ids": ids,
                "logprobs": sampler_logprobs(sample.get("logprobs"), f"samples[{i}].logprobs", len(ids)),
                "finish_reason": STOP_REASONS.get(reason) if isinstance(reason, str) else None,
            }
            if isinstance(record.get("base_model"), str):
                trace["model"] = record["base_model"]
            if isinstance(record.get("created_at"), int | float) and not isinstance(record["created_at"], bool):
                trace["created"] = record["created_at"]
            out.append(trace)
        return out


def _version(record: dict[str, Any]) -> int:
    """The sao policy version that sampled: the scope's ``policy_version`` when it names one, else 0 (the model the
    run starts from) for a sample from the base model; a sample from a Tinker checkpoint is refused."""
    scope = record["scope"]
    given = scope.get("policy_version")
    if isinstance(given, int) and not isinstance(given, bool) and given >= 0:
        return given
    if given is not None:
        raise BadRecord("scope.policy_version", f"must be a whole number >= 0, got {given!r}")
    path = record.get("model_path")
    if path:
        raise BadRecord(
            "model_path",
            f"{str(path)[:80]!r}: sampled from a Tinker checkpoint, not from the model this run starts from, and "
            "the scope names no sao policy_version; sao cannot place it among its versions",
        )
    return 0


FORMAT = TinkerCapture()
