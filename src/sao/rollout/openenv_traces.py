"""TRL's OpenEnv proxy trace, read by ``sao train --traces``: one line per model call an agent made through the proxy.

The record (``TraceEntry`` in ``trl.experimental.async_grpo.openenv_harness``): ``request`` (the chat body the agent
sent: ``messages``, ``tools``, its sampling settings), ``response`` (the upstream chat completion), the generated
``completion_token_ids`` (or ``completion_tokens`` as ``"token_id:N"`` strings, vLLM's --return-tokens-as-token-ids)
and ``per_token_logps``, one per generated token. Each line becomes one sao trajectory: the prompt is the request's
messages (with its tools) through the run's chat template, as TRL re-renders them; the action is the generated
tokens with their log-probs; the id is the response's ``id`` (else file:line); ``request.metadata``, when an object,
is the task ``--reward`` grades (as ``sao serve`` takes it); a reward can also come as a sao feedback line.

Refused in one line: no per-token log-probs, token strings that are not ids, no temperature in the request, and
sampling settings that reshape the distribution (top_p, top_k, penalties). Left out: the policy version (the entry
has none, so every line is version 0, the model the run starts from, and the footing audit checks that at staleness
0), and joining an episode's calls into one multi-turn trajectory (the entries do not mark episode boundaries).
"""

from __future__ import annotations

from typing import Any

from sao.rollout.traces import BadRecord, Tokens, line_id, sampled_temperature, sampler_logprobs

TOKEN_ID_PREFIX = "token_id:"  # how vLLM writes a token as its id (--return-tokens-as-token-ids)


class OpenEnvProxy:
    """The OpenEnv proxy trace format (a ``TraceFormat``)."""

    name = "openenv"

    def detect(self, record: dict[str, Any]) -> bool:
        return isinstance(record.get("request"), dict) and any(
            k in record for k in ("per_token_logps", "completion_token_ids", "completion_tokens")
        )

    def records(self, record: dict[str, Any], tokens: Tokens, where: str) -> list[dict[str, Any]]:
        request = record["request"]
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRecord("request.messages", "must be the non-empty list of chat messages the agent sent")
        tools = request.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRecord("request.tools", "must be a list of tool schemas or null")
        temperature = sampled_temperature(request, "request")
        ids = _completion_ids(record)
        logprobs = sampler_logprobs(record.get("per_token_logps"), "per_token_logps", len(ids))
        response = record.get("response") if isinstance(record.get("response"), dict) else {}
        choices = response.get("choices") if isinstance(response.get("choices"), list) else []
        finish = choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None
        task = request.get("metadata")
        out: dict[str, Any] = {
            "id": response["id"] if isinstance(response.get("id"), str) and response["id"] else line_id(where),
            "policy_version": 0,
            "temperature": temperature,
            "prompt_token_ids": tokens.prompt(messages, tools),
            "completion_token_ids": ids,
            "logprobs": logprobs,
            "finish_reason": "length" if finish == "length" else "stop",  # "tool_calls" ends the turn too
        }
        if isinstance(task, dict) and task:
            out["task"] = task
        model = request.get("model") or response.get("model")
        if isinstance(model, str):
            out["model"] = model
        return [out]


def _completion_ids(record: dict[str, Any]) -> list[int]:
    """The generated token ids: ``completion_token_ids``, else ``completion_tokens`` written as ids."""
    ids = record.get("completion_token_ids")
    if ids:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRecord("completion_token_ids", "must be a list of whole numbers (token ids)")
        return list(ids)
    strings = record.get("completion_tokens")
    if not strings:
        raise BadRecord("completion_token_ids", "missing: the entry holds no generated token ids")
    if not isinstance(strings, list) or not all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in strings):
        raise BadRecord(
            "completion_tokens",
            f'must be token ids written as "{TOKEN_ID_PREFIX}N" (serve with vLLM\'s '
            "--return-tokens-as-token-ids): token strings cannot be placed exactly",
        )
    try:
        return [int(t[len(TOKEN_ID_PREFIX) :]) for t in strings]
    except ValueError:
        raise BadRecord("completion_tokens", f'holds a "{TOKEN_ID_PREFIX}" entry that is not a whole number') from None


FORMAT = OpenEnvProxy()
