"""The OpenAI API's request bodies and answers, without the HTTP: parsing with checks that name
the field, and the JSON of completions, chat completions and their streamed chunks.

Accepted (besides `model`, a string not checked against the served name, and fields that do not
change the answer: user, store, metadata, service_tier, prompt_cache_key, safety_identifier,
parallel_tool_calls, top_logprobs 0): prompt (a string,
token ids, or a list of one of either), messages (content a string or a list of text and, for a
vision model, image_url parts: image_parts), max_tokens (and for chat max_completion_tokens),
temperature (0: greedy), top_p, seed, stop (a string or a list), stream,
stream_options.include_usage (with stream); extensions top_k and ignore_eos. Refused with a 400
naming the field: n, best_of != 1, echo, logprobs, suffix, logit_bias, nonzero presence /
frequency penalties, tools / functions, a tool_choice / function_call other than "none" or
"auto", modalities other than text, audio, prediction, reasoning_effort, web_search_options, a
response_format other than text, and any field not named here (as OpenAI answers an unknown one:
a setting this server would otherwise silently not apply, e.g. min_p or repetition_penalty).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import torch

from trireme.data.chat import ROLES, ChatFormat
from trireme.data.conversations import plain_prompt_ids
from trireme.errors import TriremeError
from trireme.serving.image_parts import VISION_STOP, VisionInputs, image_url, vision_prompt
from trireme.serving.sampling import SamplingParams
from trireme.serving.text import encodable


class ApiError(TriremeError):
    """An HTTP error with the OpenAI error body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    images: torch.Tensor | None = None  # [k, 3, S, S] normalized pixels (a vision model)
    open_ended: bool = False  # no max tokens given: as many as the context (and pool) hold


NUMBER = (int, float)
MAX_STOP, MAX_STOP_CHARS = 16, 1000  # stop strings per request (OpenAI: 4), and their length
TYPE_NAMES = {str: "string", int: "integer", bool: "boolean", list: "list", dict: "object"}


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """body[name] if present and not null, checked against `kinds` (bool is not a number)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        want = "number" if kinds == NUMBER else " or ".join(TYPE_NAMES[k] for k in kinds)
        raise ApiError(400, f"{name} must be of type {want}, not {type(value).__name__}", name)
    return value


SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                   "stream_options", "top_k", "ignore_eos", "n", "best_of", "echo", "logprobs",
                   "top_logprobs", "suffix", "logit_bias", "presence_penalty",
                   "frequency_penalty", "response_format", "tools", "functions", "user", "store",
                   "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_completion_tokens", "tool_choice",
                                 "function_call", "parallel_tool_calls", "modalities", "audio",
                                 "prediction", "reasoning_effort", "web_search_options"}


def _refuse_unknown(body: dict, known: set[str], endpoint: str) -> None:
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise ApiError(400, f"unrecognized request argument supplied to {endpoint}: "
                       f"{unknown[0]} (this server does not apply it)", unknown[0])
    _field(body, "model", (str,))


def _refuse_chat_features(body: dict) -> None:
    """Chat fields that would change the answer, which a plain-text model here cannot honour."""
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise ApiError(400, f"{name} must be \"none\" or \"auto\": this server calls no "
                           "tools", name)
    if body.get("modalities") not in (None, ["text"]):
        raise ApiError(400, "modalities: only [\"text\"] is supported here", "modalities")
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        if body.get(name) is not None:
            raise ApiError(400, f"{name} is not supported by this server", name)


def _refuse_unsupported(body: dict) -> None:
    for name in ("n", "best_of"):
        if _field(body, name, (int,), 1) != 1:
            raise ApiError(400, f"{name} must be 1: this server returns one choice", name)
    for name in ("echo", "logprobs", "top_logprobs", "suffix", "logit_bias"):
        value = body.get(name)  # absent, null, false or {}: not asked for (logprobs 0 asks)
        asked = not (value is None or value is False or isinstance(value, dict) and not value)
        if asked and not (name == "top_logprobs" and value == 0):  # no alternatives: none
            raise ApiError(400, f"{name} is not supported by this server", name)
    for name in ("tools", "functions"):  # a model here cannot call them: say so
        if body.get(name):
            raise ApiError(400, f"{name} are not supported by this server (plain text only)",
                           name)
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported here",
                       "response_format")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _field(body, name, NUMBER, 0.0)
        if value != 0:
            raise ApiError(400, f"{name} is not supported (only 0)", name)


def text_field(value: str, name: str) -> str:
    """`value` if it is text that can be encoded (JSON's escapes let a body carry a lone UTF-16
    surrogate, "\\ud800", which no tokenizer takes): else a 400 naming the field."""
    if not encodable(value):
        raise ApiError(400, f"{name} holds invalid Unicode (a lone surrogate escape such as "
                       "\\ud800)", name)
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"stop takes at most {MAX_STOP} strings of at most "
                       f"{MAX_STOP_CHARS} characters each", "stop")
    return [text_field(s, "stop") for s in stop]


def sampling_from(body: dict, default_max_tokens: int, max_tokens_name: str = "max_tokens"
                  ) -> SamplingParams:
    _refuse_unsupported(body)
    max_tokens = _field(body, max_tokens_name, (int,), None)
    if max_tokens is None and max_tokens_name != "max_tokens":
        max_tokens_name = "max_tokens"  # the older name, which chat requests may send too
        max_tokens = _field(body, max_tokens_name, (int,), None)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens <= 0:
        raise ApiError(400, f"{max_tokens_name} must be at least 1, got {max_tokens}",
                       max_tokens_name)
    stop = _stop_strings(body)
    temperature = _field(body, "temperature", NUMBER, 1.0)  # (SamplingParams makes floats)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=_field(body, "top_k", (int,), 0),
        top_p=_field(body, "top_p", NUMBER, 1.0), greedy=temperature == 0,
        seed=_field(body, "seed", (int,), None), stop=tuple(stop),
        ignore_eos=_field(body, "ignore_eos", (bool,), False))
    problem = params.problem()
    if problem:
        raise ApiError(400, problem, problem.split()[0])
    return params


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,), {})
    if options and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true",
                       "stream_options")
    return stream, bool(_field(options, "include_usage", (bool,), False))


def parse_completion(body: Any, tokenizer) -> ParsedRequest:
    """POST /v1/completions' body -> prompt ids and settings (ApiError 400 if malformed)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refuse_unknown(body, COMPLETION_FIELDS, "/v1/completions")
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(text_field(prompt, "prompt")) or [tokenizer.eod]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        ids = list(prompt)
    else:
        raise ApiError(400, "prompt must be a string or a non-empty list of token ids (one "
                       "prompt per request)", "prompt")
    params = sampling_from(body, default_max_tokens=16)
    return ParsedRequest(ids, params, *_stream_flags(body))


def parse_chat(body: Any, tokenizer, chat: ChatFormat, context: int,
               vision: VisionInputs | None = None) -> ParsedRequest:
    """POST /v1/chat/completions' body -> the templated prompt's ids and settings; for a vision
    model (`vision`), the prompt of trireme.serving.image_parts and the images' pixels."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refuse_unknown(body, CHAT_FIELDS, "/v1/chat/completions")
    _refuse_chat_features(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    plain, urls = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] needs a role, one of {', '.join(ROLES)}",
                           "messages")
        content = message.get("content")
        if content is None and message["role"] == "assistant":
            content = ""  # an assistant turn that only called tools has no text
        text, images = _content(content, i)
        if images and (vision is None or message["role"] != "user"):
            raise ApiError(400, f"messages[{i}] has an image, but " + (
                "this model takes no images" if vision is None else "only user messages may"),
                "messages")
        plain.append({"role": message["role"], "content": text})
        urls += images
    ids, pixels = _prompt(plain, urls, tokenizer, chat, vision)
    params = sampling_from(body, default_max_tokens=context,
                           max_tokens_name="max_completion_tokens")
    turn_end = chat.stop if vision is None else VISION_STOP  # the template's, the framing's
    if turn_end and not set(turn_end) <= set(params.stop):
        params = replace(params, stop=params.stop + turn_end)  # an answer ends with its turn
    open_ended = all(body.get(name) is None for name in ("max_completion_tokens", "max_tokens"))
    return ParsedRequest(ids, params, *_stream_flags(body), images=pixels, open_ended=open_ended)


def _prompt(plain: list[dict[str, str]], urls: list[str], tokenizer, chat: ChatFormat,
            vision: VisionInputs | None) -> tuple[list[int], torch.Tensor | None]:
    """Prompt ids (and pixels) of checked messages: the chat template, the plain one as chat
    data trains it (trireme.data.conversations), or a vision model's conversation framing
    (trireme.serving.image_parts)."""
    try:
        if vision is not None:
            return vision_prompt([(m["role"], m["content"]) for m in plain], urls, tokenizer,
                                 vision)
        if chat.template is None:  # earlier answers end with eod, as chat data trains them
            return plain_prompt_ids(tokenizer, plain), None
        return tokenizer.encode(chat.render(plain)) or [tokenizer.eod], None
    except TriremeError as e:
        raise ApiError(400, str(e), "messages") from None


def _content(content: Any, i: int) -> tuple[str, list[str]]:
    """A message's text and image URLs: a string, or a list of text and image_url parts."""
    if isinstance(content, str):
        return text_field(content, "messages"), []
    where = f"messages[{i}].content"
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content parts", "messages")
    texts, urls = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(text_field(part["text"], "messages"))
        elif kind == "image_url":
            try:
                urls.append(image_url(part, f"{where}[{j}]"))
            except TriremeError as e:
                raise ApiError(400, str(e), "messages") from None
        else:
            raise ApiError(400, f"{where}[{j}] must be a {{\"type\": \"text\", \"text\": ...}} "
                           "or {\"type\": \"image_url\", ...} part", "messages")
    return "".join(texts), urls


# ---------------------------------------------------------------------------- answers


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Answer:
    """Builds the JSON of one request's answer, whole or as stream chunks; `chat` picks the
    chat.completion shapes."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, prompt_tokens: int,
              completion_tokens: int) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish_reason: str | None = None,
              first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": usage(prompt_tokens,
                                                                  completion_tokens)}
