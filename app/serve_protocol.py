"""`mmpipe serve`'s wire format: OpenAI request bodies checked and turned into mmpipe conversations,
prompts and `SamplingParams`, media sources checked against the server's policy (data URIs; local
files only under --allowed-local-media-path; no network URLs), and the response objects (choices,
logprobs, usage, errors)."""

from __future__ import annotations

import os
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any

from mmpipe.config import SamplingParams
from mmpipe.errors import InputError

ROLES = ("system", "user", "assistant")
MAX_N = 16  # choices a request may ask for


class ApiError(Exception):
    """An error answered as OpenAI's error object, with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass
class Job:
    """One checked request: what to run (a conversation, or one prompt per entry) and how."""

    model: str
    sampling: list[SamplingParams]  # one per choice (n)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    conversation: list[dict[str, Any]] | None = None
    prompts: list[str] = field(default_factory=list)
    echo: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


def _number(body: dict[str, Any], name: str, kind: type, low: float | None = None, high: float | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int and ok and isinstance(value, float):
        ok = value.is_integer()
    if not ok:
        raise bad(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    value = kind(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def _model(body: dict[str, Any], names: tuple[str, ...]) -> str:
    model = body.get("model")
    if model is None:
        return names[0]
    if model not in names:
        raise ApiError(400, f"the model {model!r} does not exist; this server serves {', '.join(map(repr, names))}",
                       param="model", code="model_not_found")
    return model


def sampling_of(body: dict[str, Any], chat: bool) -> tuple[list[SamplingParams], bool]:
    """One `SamplingParams` per choice, and whether logprobs were asked for. Fields the body
    leaves out stay None, so the checkpoint's generation_config.json fills them."""
    n = _number(body, "n", int, 1, MAX_N) or 1
    max_tokens = _number(body, "max_completion_tokens", int, 1) if chat else None
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int, 1)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                            and all(isinstance(s, str) for s in stop))):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if stop == [] or stop == "":
        stop = None
    if chat:
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise bad("'logprobs' must be true or false", "logprobs")
        top = _number(body, "top_logprobs", int, 0, 20)
        if top and not logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        k = (top or 0) if logprobs else None
    else:
        k = _number(body, "logprobs", int, 0, 5)
        logprobs = k is not None
    seed = _number(body, "seed", int)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("'ignore_eos' must be true or false", "ignore_eos")
    common = {"max_new_tokens": max_tokens, "temperature": _number(body, "temperature", float, 0, 2),
                  "top_p": _number(body, "top_p", float, 0, 1), "top_k": _number(body, "top_k", int, -1),
                  "min_p": _number(body, "min_p", float, 0, 1),
                  "repetition_penalty": _number(body, "repetition_penalty", float),
                  "min_new_tokens": _number(body, "min_tokens", int, 0) or 0, "stop": stop, "logprobs": k,
                  "ignore_eos": ignore_eos}
    for name in ("frequency_penalty", "presence_penalty"):
        common[name] = _number(body, name, float, -2, 2) or 0.0
    common["json_schema"] = _response_format(body.get("response_format"))
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise bad("'cache_salt' must be a non-empty string", "cache_salt")
    common["cache_salt"] = salt
    if common["top_k"] == -1:  # vLLM's "no top-k"
        common["top_k"] = 0
    if common["top_p"] == 0:
        raise bad("'top_p' must be above 0", "top_p")
    try:  # a seeded request's choices differ from each other, and each is reproducible
        params = [SamplingParams(**common, seed=None if seed is None else seed + i) for i in range(n)]
    except InputError as exc:
        raise bad(str(exc)) from None
    return params, logprobs


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's `response_format` as the JSON Schema the output must follow: `{"type": "text"}`
    (or none) leaves it free; `{"type": "json_object"}` asks for any JSON object;
    `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}` for that schema
    (`strict` is accepted: the grammar always holds the output to the schema)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("'response_format.json_schema.schema' must be a JSON Schema object",
                      "response_format.json_schema")
        return schema
    raise bad("'response_format.type' must be 'text', 'json_object' or 'json_schema'", "response_format")


def parse_chat(body: Any, names: tuple[str, ...], allowed: str | None) -> Job:
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    model = _model(body, names)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    conversation = [_message(m, i, allowed) for i, m in enumerate(messages)]
    sampling, logprobs = sampling_of(body, chat=True)
    stream, include_usage = _stream_flags(body)
    return Job(model, sampling, stream, include_usage, logprobs, conversation=conversation)


def parse_completion(body: Any, names: tuple[str, ...]) -> Job:
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    model = _model(body, names)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise bad("'prompt' must be a non-empty string or a list of them (token ids are not accepted)", "prompt")
    if body.get("suffix") is not None:
        raise bad("'suffix' is not supported", "suffix")
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise bad("'echo' must be true or false", "echo")
    sampling, logprobs = sampling_of(body, chat=False)
    stream, include_usage = _stream_flags(body)
    return Job(model, sampling, stream, include_usage, logprobs, prompts=prompts, echo=echo)


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    return stream, bool(options.get("include_usage"))


def _message(message: Any, i: int, allowed: str | None) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise bad(f"{where}: a message is an object with a 'role' of {', '.join(ROLES)}", "messages")
    content = message.get("content")
    if isinstance(content, str):
        return {"role": message["role"], "content": [{"type": "text", "text": content}]}
    if not isinstance(content, list):
        raise bad(f"{where}: 'content' must be a string or a list of parts", "messages")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image_url", "video_url"):
            inner = part.get(kind)
            url = inner.get("url") if isinstance(inner, dict) else inner if isinstance(inner, str) else None
            if not isinstance(url, str) or not url:
                raise bad(f"{where}.content[{k}]: a {kind} part is {{'type': '{kind}', '{kind}': {{'url': ...}}}}",
                          "messages")
            parts.append({"type": kind, kind: {"url": check_media_url(url, f"{where}.content[{k}]", allowed)}})
        else:
            raise bad(f"{where}.content[{k}]: parts are text, image_url or video_url, got {kind!r}", "messages")
    return {"role": message["role"], "content": parts}


def check_media_url(url: str, where: str, allowed: str | None) -> str:
    """A data URI passes; a local file (a path or file:// URI) passes only under `allowed`; anything
    else (http, https, ftp, ...) is refused."""
    if url.startswith("data:"):
        return url
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme == "file":
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise bad(f"{where}: a file URI must name a local absolute path (file:///path)", "messages")
        path = urllib.parse.unquote(parsed.path)
    elif scheme and len(scheme) > 1:  # a single letter is a Windows drive
        raise bad(f"{where}: network URLs ({scheme}://) are not fetched by this server; send the file as a data: "
                  "URI", "messages")
    else:
        path = url
    if allowed is None:
        raise bad(f"{where}: local files are not allowed (start the server with --allowed-local-media-path)",
                  "messages")
    real = os.path.realpath(path)
    if not os.path.isabs(path) or os.path.commonpath([real, allowed]) != allowed:
        raise bad(f"{where}: {path!r} is not under the allowed local media path", "messages")
    return real


# ------------------------------------------------------------------ responses


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]], top: int) -> list[dict]:
    """OpenAI's `logprobs.content` list: one entry per generated token, with its `top` most likely."""
    out = []
    for token, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token)
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        out.append({"token": text, "logprob": entry.get(token, float("-inf")), "bytes": list(text.encode()),
                    "top_logprobs": [{"token": (t := token_text(tokenizer, tid)), "logprob": lp,
                                      "bytes": list(t.encode())} for tid, lp in ranked]})
    return out


def completion_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]],
                        top: int) -> dict[str, Any]:
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [e.get(t, float("-inf")) for t, e in zip(token_ids, entries)],
            "top_logprobs": [{token_text(tokenizer, tid): lp for tid, lp in sorted(e.items(), key=lambda kv: -kv[1])[:top]}
                             for e in entries],
            "text_offset": offsets}


def finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason or "", reason)


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached`: prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
