"""How to generate: what a caller asks (`SamplingParams`), the checkpoint's defaults
(`GenerationDefaults`) and the settings the engine and sampler consume (`ResolvedSampling`)."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from mmpipe.errors import InputError
from mmpipe.json_grammar import schema_error


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. A field left as None takes the checkpoint's generation_config.json value,
    then mmpipe's default (greedy, 256 new tokens).

    temperature 0 means greedy. `seed` makes a sampled request reproducible whatever else is in
    the batch. `stop` strings are cut from the returned text. `logprobs=k` returns, for each
    generated token, the k most likely tokens of the model's distribution with their
    log-probabilities (plus the sampled token).

    `frequency_penalty` and `presence_penalty` (OpenAI's, -2 to 2) lower a token's logit by
    frequency_penalty x its count among the generated tokens, plus presence_penalty if it occurs
    there at all. `json_schema` (a JSON Schema as a dict or a JSON string; `{"type": "object"}`
    for any object) constrains the output to JSON that validates against it: at every step only
    tokens that keep the text a valid prefix are allowed, and the end of sequence only once it is
    complete. `cache_salt` keeps the request's prefix-cache entries apart: only requests with the
    same salt share cached pages (give one per user or tenant who must not share them).
    """

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    json_schema: dict[str, Any] | str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InputError(f"SamplingParams.cache_salt={self.cache_salt!r}: give a string")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            if not isinstance(self.stop, (list, tuple)):
                raise InputError(f"SamplingParams.stop={self.stop!r}: give a string or a list of strings")
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or any(
                    not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0 for t in ids):
                raise InputError(f"SamplingParams.stop_token_ids={ids!r}: give a list of token ids "
                                 "(non-negative integers)")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        _check("max_new_tokens", self.max_new_tokens, lambda v: isinstance(v, int) and v >= 1, ">= 1")
        _check("min_new_tokens", self.min_new_tokens, lambda v: isinstance(v, int) and v >= 0, ">= 0")
        _check("temperature", self.temperature, lambda v: math.isfinite(v) and v >= 0, ">= 0")
        _check("top_k", self.top_k, lambda v: isinstance(v, int) and v >= 0, ">= 0 (0 disables it)")
        _check("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check("repetition_penalty", self.repetition_penalty, lambda v: math.isfinite(v) and v > 0, "> 0")
        _check("logprobs", self.logprobs, lambda v: isinstance(v, int) and 0 <= v <= 100, "in [0, 100]")
        _check("seed", self.seed, lambda v: isinstance(v, int), "an integer")
        for name in ("frequency_penalty", "presence_penalty"):
            _check(name, getattr(self, name), lambda v: -2.0 <= v <= 2.0, "in [-2, 2]")
        if self.json_schema is not None and self.min_new_tokens:
            raise InputError("SamplingParams: min_new_tokens cannot be combined with json_schema (the schema "
                             "decides where the output may end)")
        if self.stop is not None and any((not isinstance(s, str)) or not s for s in self.stop):
            raise InputError(f"SamplingParams.stop={self.stop!r}: stop strings must be non-empty strings")
        if (self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens):
            raise InputError(f"SamplingParams: min_new_tokens={self.min_new_tokens} exceeds "
                             f"max_new_tokens={self.max_new_tokens}")

    def resolve(self, defaults: "GenerationDefaults") -> "ResolvedSampling":
        """Fill unset fields from the checkpoint's defaults."""
        temperature = self.temperature if self.temperature is not None else defaults.temperature
        max_new = self.max_new_tokens if self.max_new_tokens is not None else defaults.max_new_tokens
        if self.min_new_tokens > max_new:
            raise InputError(f"SamplingParams: min_new_tokens={self.min_new_tokens} exceeds "
                             f"max_new_tokens={max_new}")
        stop_ids = set(self.stop_token_ids or ())
        eos_ids = () if self.ignore_eos else tuple(defaults.eos_token_ids)
        return ResolvedSampling(
            max_new_tokens=max_new,
            min_new_tokens=self.min_new_tokens,
            temperature=float(temperature),
            top_k=self.top_k if self.top_k is not None else defaults.top_k,
            top_p=float(self.top_p if self.top_p is not None else defaults.top_p),
            min_p=float(self.min_p if self.min_p is not None else defaults.min_p),
            repetition_penalty=float(self.repetition_penalty if self.repetition_penalty is not None
                                     else defaults.repetition_penalty),
            seed=self.seed,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(sorted(stop_ids)),
            eos_token_ids=eos_ids,
            logprobs=self.logprobs or 0,
            skip_special_tokens=self.skip_special_tokens,
            frequency_penalty=float(self.frequency_penalty),
            presence_penalty=float(self.presence_penalty),
            json_schema=self.json_schema,  # type: ignore[arg-type]  (made a string by __post_init__)
            cache_salt=self.cache_salt or None,
        )


def _schema_text(schema: Any) -> str:
    """A JSON Schema given as a dict or a JSON string, as compact JSON text (the key to its compiled
    grammar); InputError naming `json_schema` otherwise."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InputError(f"SamplingParams.json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InputError(f"SamplingParams.json_schema: give a JSON Schema object (a dict), not "
                         f"{type(schema).__name__}")
    try:
        text = json.dumps(schema, separators=(",", ":"))  # key order kept: it is the order of the properties
    except (TypeError, ValueError) as exc:
        raise InputError(f"SamplingParams.json_schema cannot be written as JSON: {exc}") from None
    error = schema_error(text)  # (llguidance loads only when a schema is given)
    if error:
        raise InputError(f"SamplingParams.json_schema cannot be compiled: {error}")
    return text


def _check(name: str, value: Any, ok: Any, what: str) -> None:
    if value is None:
        return
    try:
        good = bool(ok(value))
    except TypeError:
        good = False
    if not good or isinstance(value, bool):
        raise InputError(f"SamplingParams.{name}={value!r}: must be {what}")


@dataclass(frozen=True)
class GenerationDefaults:
    """The checkpoint's generation_config.json, reduced to what the sampler uses."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], extra_eos: tuple[int, ...] = ()) -> "GenerationDefaults":
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        eos_ids += [e for e in extra_eos if e not in eos_ids]
        do_sample = bool(cfg.get("do_sample", False))
        return cls(
            max_new_tokens=int(cfg.get("max_new_tokens") or cls.max_new_tokens),
            temperature=float(cfg.get("temperature", 1.0) or 0.0) if do_sample else 0.0,
            top_k=int(cfg.get("top_k") or 0) if do_sample else 0,
            top_p=float(cfg.get("top_p") or 1.0) if do_sample else 1.0,
            min_p=float(cfg.get("min_p") or 0.0) if do_sample else 0.0,
            repetition_penalty=float(cfg.get("repetition_penalty") or 1.0),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )


@dataclass(frozen=True)
class ResolvedSampling:
    """SamplingParams with every field decided; what the engine and sampler consume."""

    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    eos_token_ids: tuple[int, ...]
    logprobs: int
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    json_schema: str | None = None  # canonical JSON text of the schema the output must follow
    cache_salt: str | None = None  # seeds the prefix cache's keys (see SamplingParams)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
