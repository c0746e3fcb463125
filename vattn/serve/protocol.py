"""What a request to `vattn serve --engine vattn` may hold, read into `SamplingParams`.

One rule: **nothing a client sends is silently ignored.** Every field vLLM's OpenAI server
accepts is either honoured (`HONOURED`, mapped onto `vattn.engine.SamplingParams`) or
refused with 400 and an OpenAI error body naming it (`refuse_unless_default`: a value other
than the no-op one); a field nobody knows is refused too (400, `unknown_field`), where vLLM
would ignore it with a warning. `null` means "not given" for every optional field.
`user` is accepted and recorded nowhere (OpenAI uses it for abuse monitoring; this server
has none).

Plain Python: no torch, no FastAPI (the routes in `vattn.serve.app` call `read_completion`
and `read_chat`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from vattn.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from vattn.errors import InvalidRequestError
from vattn.integrations.hf_serve.contract import MAX_N, Refusal

# The fields both endpoints honour (vLLM's names; `max_tokens` is chat's older spelling of
# `max_completion_tokens`). `user` is accepted and recorded nowhere.
COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "logprobs", "skip_special_tokens", "user", "stream", "stream_options",
    "logit_bias", "response_format", "best_of",
})
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "prompt_logprobs"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "parallel_tool_calls", "prompt_logprobs"}
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids, and its text when the client sent text."""

    token_ids: list[int]
    text: str | None = None


@dataclass
class GenerationRequest:
    """A checked `/v1/completions` or `/v1/chat/completions` body (`max_tokens` None: up to
    the context's end, per prompt, as vLLM does)."""

    chat: bool
    model: str | None
    params: SamplingParams  # max_tokens is a placeholder until `params_for` sets it per prompt
    max_tokens: int | None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    # completions: `logprobs: k` -> k alternatives; chat: `logprobs: true` + `top_logprobs: k`
    logprobs: int | None = None
    prompts: list[Any] = field(default_factory=list)  # completions: the prompts as sent (text or ids)
    messages: list[dict] = field(default_factory=list)  # chat: messages, each content flattened to a string

    def params_for(self, num_prompt_tokens: int, max_context_len: int) -> SamplingParams:
        """The SamplingParams of one prompt: max_tokens as asked, or what the context has left
        (`Refusal` when a prompt and its max_tokens cannot fit into the context)."""
        param = "messages" if self.chat else "prompt"
        left = max_context_len - num_prompt_tokens
        if left < 1:
            raise Refusal(f"this model's maximum context length is {max_context_len} tokens, and the prompt is "
                          f"{num_prompt_tokens} tokens, leaving no room for one new token: shorten the prompt",
                          param=param, code="context_length_exceeded")
        wanted = self.max_tokens if self.max_tokens is not None else left
        if wanted > left:
            name = "max_completion_tokens" if self.chat else "max_tokens"
            raise Refusal(f"this model's maximum context length is {max_context_len} tokens; the prompt is "
                          f"{num_prompt_tokens} tokens and {name} is {wanted} ({num_prompt_tokens + wanted} in all): "
                          f"lower {name} to at most {left} or shorten the prompt", param=name,
                          code="context_length_exceeded")
        if self.params.min_tokens > wanted:
            raise Refusal(f"min_tokens ({self.params.min_tokens}) is more than the {wanted} tokens this prompt may "
                          "generate", param="min_tokens", code="invalid_value")
        return _replace(self.params, max_tokens=wanted)


def _replace(params: SamplingParams, **changes: Any) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **changes)


# ------------------------------------------------------------------ checks ----
def _bad(param: str, expected: str, value: Any, code: str = "invalid_type") -> Refusal:
    shown = repr(value) if isinstance(value, (str, bool, int, float)) or value is None else type(value).__name__
    return Refusal(f"invalid {param!r}: expected {expected}, got {shown[:80]}", param=param, code=code)


def _int(body: dict, name: str, low: int | None = None, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    span = "" if low is None else f" >= {low}" if high is None else f" in [{low}, {high}]"
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"an integer{span}", v)
    if (low is not None and v < low) or (high is not None and v > high):
        raise _bad(name, f"an integer{span}", v, "invalid_value")
    return v


def _float(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, "a finite number", v)
    return float(v)


def _bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise _bad(name, "a boolean", v)
    return v


def refuse_unless_default(body: dict) -> None:
    """400 for a field vattn does not build, unless it holds the value that changes nothing."""
    def no(name: str, why: str) -> Refusal:
        return Refusal(f"{name!r} is not supported by vattn serve ({why}); leave it out", param=name,
                       code="unsupported_field")

    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise no("response_format", "only {\"type\": \"text\"}: no JSON or schema-guided decoding")
    if body.get("tools") not in (None, []):
        raise no("tools", "no tool calling")
    if body.get("tool_choice") not in (None, "none"):
        raise no("tool_choice", "no tool calling: only \"none\"")
    _bool(body, "parallel_tool_calls")  # tools are refused above: there are no calls to parallelize
    if body.get("prompt_logprobs") is not None:
        raise no("prompt_logprobs", "the engine computes log-probabilities of generated tokens only")
    if body.get("logit_bias") not in (None, {}):
        raise no("logit_bias", "no per-token logit bias in the engine's sampler")
    if body.get("suffix") not in (None, ""):
        raise no("suffix", "no fill-in-the-middle")
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != (body.get("n") or 1):
        raise no("best_of", "only best_of equal to n: every sample generated is returned")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("stop", "a string or an array of strings", stop)
    return tuple(s for s in items if s)  # "" never matches: OpenAI and vLLM drop it


def _sampling(body: dict, chat: bool) -> tuple[SamplingParams, int | None, int | None]:
    """(SamplingParams with a placeholder max_tokens, max_tokens asked (None: the context's
    end), logprobs alternatives asked (None: no logprobs))."""
    if chat:
        limits = [v for k in ("max_completion_tokens", "max_tokens") if (v := _int(body, k, 1)) is not None]
        max_tokens = limits[0] if limits else None
        want = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and top > 0 and not want:
            raise Refusal("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        logprobs = (top or 0) if want else None
    else:
        max_tokens = _int(body, "max_tokens", 1)
        logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids)):
        raise _bad("stop_token_ids", "an array of token ids (integers >= 0)", stop_ids)
    kw: dict[str, Any] = {
        "temperature": _float(body, "temperature"), "top_p": _float(body, "top_p"), "top_k": _int(body, "top_k", -1),
        "min_p": _float(body, "min_p"), "seed": _int(body, "seed"), "n": _int(body, "n", 1, MAX_N),
        "presence_penalty": _float(body, "presence_penalty"), "frequency_penalty": _float(body, "frequency_penalty"),
        "repetition_penalty": _float(body, "repetition_penalty"), "min_tokens": _int(body, "min_tokens", 0),
        "stop_token_ids": tuple(stop_ids or ()), "stop": _stop(body), "logprobs": logprobs,
        "ignore_eos": _bool(body, "ignore_eos"), "skip_special_tokens": _bool(body, "skip_special_tokens"),
        "include_stop_str_in_output": _bool(body, "include_stop_str_in_output"),
    }
    kw = {k: v for k, v in kw.items() if v is not None}
    if max_tokens is not None and kw.get("min_tokens", 0) > max_tokens:
        raise Refusal(f"min_tokens ({kw['min_tokens']}) is more than max_tokens ({max_tokens})", param="min_tokens",
                      code="invalid_value")
    try:  # the engine's own checks (ranges): one message, with the field it names
        params = SamplingParams(max_tokens=max_tokens or max(1, kw.get("min_tokens", 1)), **kw)
    except InvalidRequestError as e:
        name = str(e).split()[0]
        raise Refusal(str(e), param=name if name in kw else None, code="invalid_value") from None
    return params, max_tokens, logprobs


def _stream(body: dict) -> tuple[bool, bool, bool]:
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False, False
    if not stream:
        raise Refusal("'stream_options' is only for streamed requests: send 'stream': true or leave it out",
                      param="stream_options", code="invalid_value")
    if not isinstance(opts, dict):
        raise _bad("stream_options", "an object", opts)
    unknown = sorted(set(opts) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise Refusal(f"unknown field 'stream_options.{unknown[0]}': vattn serve takes include_usage and "
                      "continuous_usage_stats", param=f"stream_options.{unknown[0]}", code="unknown_field")
    include = _bool(opts, "include_usage")
    continuous = _bool(opts, "continuous_usage_stats")
    return stream, bool(include), bool(continuous)


def _check_fields(body: dict, allowed: frozenset, endpoint: str) -> None:
    unknown = sorted(set(body) - allowed)
    if "use_beam_search" in unknown and body.get("use_beam_search"):
        raise Refusal("'use_beam_search': beam search runs in process (vattn.LLM.beam_search holds the engine "
                      "alone, docs/engine.md), not beside a server's other requests; drop the field",
                      param="use_beam_search", code="unsupported_field")
    if unknown:
        name = unknown[0]
        raise Refusal(f"unknown field {name!r} for {endpoint}: vattn serve refuses what it would not honour "
                      "(nothing a client sends is silently ignored); see docs/servers.md for the fields it takes",
                      param=name, code="unknown_field")


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "a string", model)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "a string", body["user"])
    return model


def read_completion(body: dict) -> GenerationRequest:
    """A `/v1/completions` body -> GenerationRequest, or `Refusal` (400) naming the field."""
    _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    refuse_unless_default(body)
    prompts = _prompts(body.get("prompt"))
    params, max_tokens, logprobs = _sampling(body, chat=False)
    stream, usage, continuous = _stream(body)
    echo = bool(_bool(body, "echo"))
    if echo and logprobs is not None:
        raise Refusal("'echo' with 'logprobs' needs the prompt's log-probabilities, which the engine does not "
                      "compute: drop one of them", param="echo", code="unsupported_field")
    return GenerationRequest(False, _model(body), params, max_tokens, stream, usage, continuous, echo, logprobs,
                             prompts=prompts)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """`prompt`: a string, an array of strings, an array of token ids, or an array of those."""
    expected = "a string, an array of strings, an array of token ids or an array of arrays of token ids"
    if prompt is None:
        raise Refusal("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise _bad("prompt", expected, prompt, "invalid_type" if not isinstance(prompt, list) else "empty_array")
    for i, p in enumerate(items):
        if isinstance(p, str):
            if not p:
                raise Refusal("the prompt is empty: send at least one character", param="prompt",
                              code="empty_prompt")
        elif not (isinstance(p, list) and p and all(_is_token(t) for t in p)):
            raise _bad(f"prompt[{i}]" if len(items) > 1 else "prompt", expected, p)
    return items


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def read_chat(body: dict) -> GenerationRequest:
    """A `/v1/chat/completions` body -> GenerationRequest, or `Refusal` (400) naming the field."""
    _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    refuse_unless_default(body)
    messages = _messages(body.get("messages"))
    params, max_tokens, logprobs = _sampling(body, chat=True)
    stream, usage, continuous = _stream(body)
    return GenerationRequest(True, _model(body), params, max_tokens, stream, usage, continuous, False, logprobs,
                             messages=messages)


def _messages(messages: Any) -> list[dict]:
    """The messages, each with its content as one string (text parts joined), for the
    checkpoint's chat template."""
    if messages is None:
        raise Refusal("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty array of messages", messages)
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in MESSAGE_ROLES:
            raise _bad(where, f"an object whose 'role' is one of {', '.join(MESSAGE_ROLES)}", m)
        unknown = sorted(set(m) - {"role", "content", "name", "tool_call_id", "tool_calls"})
        if unknown:
            raise Refusal(f"unknown field {unknown[0]!r} in {where}", param=f"{where}.{unknown[0]}",
                          code="unknown_field")
        if m.get("tool_calls"):
            raise Refusal(f"{where}.tool_calls: vattn serve has no tool calling", param=f"{where}.tool_calls",
                          code="unsupported_field")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise Refusal(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  "are supported: this server serves a text model", param=f"{where}.content",
                                  code="unsupported_content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"{where}.content", "a string or an array of text parts", content)
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out
