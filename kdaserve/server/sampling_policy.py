"""Sampling policies: the sampling parameters a model is served with, as a vendor declares them.

A policy maps each mode ("thinking", "non_thinking") to rules per parameter: a default used when
the request omits the parameter, and the values allowed (a list, or a [min, max] range); any
other value is refused with HTTP 400 naming the parameter and what is allowed. Sources:
`--sampling-policy NAME|FILE` (JSON in the format below), else a checkpoint's
`generation_config.json` (a `sampling_policy` object in that format, or HF's plain
`temperature`/`top_p`/`top_k` as defaults only), else none (every value allowed, no defaults).

    {"thinking": {"temperature": {"default": 1.0, "min": 0.0, "max": 1.0},
                  "top_p": {"default": 0.95, "allowed": [0.95]}}, "non_thinking": {...}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PARAMS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "n")
MODES = ("thinking", "non_thinking")


@dataclass(frozen=True)
class Rule:
    default: float | None = None
    allowed: tuple[float, ...] | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def parse(cls, raw: Any, where: str) -> Rule:
        if not isinstance(raw, dict) or set(raw) - {"default", "allowed", "min", "max"}:
            raise ValueError(f"{where}: a rule is an object with default/allowed/min/max")
        allowed = raw.get("allowed")
        return cls(raw.get("default"), tuple(allowed) if allowed is not None else None,
                   raw.get("min"), raw.get("max"))

    def permits(self, value: float) -> bool:
        if self.allowed is not None and not any(abs(value - a) < 1e-9 for a in self.allowed):
            return False
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def describe(self) -> str:
        parts = []
        if self.allowed is not None:
            parts.append("one of " + ", ".join(str(a) for a in self.allowed))
        if self.min is not None or self.max is not None:
            parts.append(f"in [{self.min if self.min is not None else '-inf'}, "
                         f"{self.max if self.max is not None else 'inf'}]")
        return " and ".join(parts) or "any value"


@dataclass(frozen=True)
class SamplingPolicy:
    name: str
    modes: dict[str, dict[str, Rule]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, name: str, raw: Any) -> SamplingPolicy:
        if not isinstance(raw, dict) or not raw or set(raw) - set(MODES):
            raise ValueError(f"sampling policy {name}: expected an object with keys {MODES}")
        modes = {}
        for mode, rules in raw.items():
            if not isinstance(rules, dict) or set(rules) - set(PARAMS):
                raise ValueError(f"sampling policy {name}.{mode}: parameters must be among "
                                 f"{PARAMS}")
            modes[mode] = {p: Rule.parse(r, f"{name}.{mode}.{p}") for p, r in rules.items()}
        return cls(name, modes)

    def apply(self, values: dict[str, Any], thinking: bool) -> dict[str, Any]:
        """`values` (None = omitted) with defaults filled in; ValueError for a refused one."""
        mode = "thinking" if thinking else "non_thinking"
        rules = self.modes.get(mode, {})
        out = dict(values)
        for param, rule in rules.items():
            value = values.get(param)
            if value is None:
                if rule.default is not None:
                    out[param] = rule.default
            elif not rule.permits(value):
                raise ValueError(
                    f"{param}={value} is not allowed by the {self.name} sampling policy "
                    f"({mode.replace('_', '-')} mode): {param} must be {rule.describe()}")
        return out


# What Moonshot serves Kimi K3 with (the Kimi Vendor Verifier's tests/params): temperature 1.0
# thinking / 0.6 instant by default and never above 1; top_p 0.95, no penalties, n = 1.
_K3_FIXED = {"top_p": {"default": 0.95, "allowed": [0.95]},
             "presence_penalty": {"default": 0.0, "allowed": [0.0]},
             "frequency_penalty": {"default": 0.0, "allowed": [0.0]},
             "n": {"default": 1, "allowed": [1]}}
BUILTIN = {
    "kimi-k3": {"thinking": {"temperature": {"default": 1.0, "min": 0.0, "max": 1.0},
                             **_K3_FIXED},
                "non_thinking": {"temperature": {"default": 0.6, "min": 0.0, "max": 1.0},
                                 **_K3_FIXED}},
}


def load_policy(spec: str | None, checkpoint: str | Path | None) -> SamplingPolicy | None:
    """`spec`: a built-in name or a JSON file; without one, the checkpoint's declaration."""
    if spec is not None:
        if spec in BUILTIN:
            return SamplingPolicy.from_dict(spec, BUILTIN[spec])
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"--sampling-policy {spec!r} is neither a file nor a built-in "
                             f"policy ({', '.join(BUILTIN)})")
        return SamplingPolicy.from_dict(path.name, json.loads(path.read_text()))
    if checkpoint is None:
        return None
    gen = Path(checkpoint) / "generation_config.json"
    if not gen.is_file():
        return None
    raw = json.loads(gen.read_text())
    if "sampling_policy" in raw:
        return SamplingPolicy.from_dict(str(gen), raw["sampling_policy"])
    defaults = {p: {"default": raw[p]} for p in ("temperature", "top_p", "top_k") if p in raw}
    if not defaults:
        return None
    return SamplingPolicy.from_dict(str(gen), dict.fromkeys(MODES, defaults))
