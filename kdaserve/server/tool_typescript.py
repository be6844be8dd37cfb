"""OpenAI tools as TypeScript declarations, the `tools_ts_str` that Moonshot's tokenizer hands
Kimi chat templates (K2.5-style templates declare tools this way instead of as JSON).

Written from the reference's observable output (`tokenization_kimi.py`'s
`encode_tools_to_typescript_style`; tests compare the two over every schema of the Kimi Vendor
Verifier): `namespace functions { ... }` of `type NAME = (_: {...}) => any;`, required fields
first and sorted, `//` comments for descriptions, constraints and defaults, `$defs` as
interfaces. A schema the reference cannot express gives None (the template then falls back).
"""

from __future__ import annotations

import json
from typing import Any

INDENT = "  "
SCALAR_CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"),
                      "number": ("maximum", "minimum"), "integer": ("maximum", "minimum")}
UNION_NAMES = {"string": "string", "number": "number", "integer": "number",
               "boolean": "boolean", "null": "null", "object": "{}", "array": "Array<any>"}


def comment(text: str, indent: str = "") -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class _Defs:
    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}
        self.self_ref = False


class _Type:
    """One parsed schema: its TypeScript text and its leading comment lines."""

    def __init__(self, schema: dict[str, Any], constraint_keys: tuple[str, ...] = ()) -> None:
        self.description = schema.get("description", "")
        self.constraints = {k: v for k, v in schema.items() if k in constraint_keys}

    def doc(self, indent: str) -> str:
        lines = []
        if self.description:
            lines.append(comment(self.description, indent))
        if self.constraints:
            lines.append(f"{indent}// " + ", ".join(f"{k}: {v}" for k, v in
                                                    sorted(self.constraints.items())))
        return "".join(line + "\n" for line in lines)

    def ts(self, indent: str = "") -> str:
        raise NotImplementedError


class _Scalar(_Type):
    def __init__(self, kind: str, schema: dict[str, Any] | None = None) -> None:
        super().__init__(schema or {}, SCALAR_CONSTRAINTS.get(kind, ()))
        self.kind = kind

    def ts(self, indent: str = "") -> str:
        return "number" if self.kind == "integer" else self.kind


class _Field:
    def __init__(self, name: str, type_: _Type, optional: bool, default: Any) -> None:
        self.name, self.type, self.optional, self.default = name, type_, optional, default

    def ts(self, indent: str) -> str:
        text = self.type.doc(indent)
        if self.default is not None:
            value = repr(self.default) if isinstance(self.default, int | float | bool) \
                else json.dumps(self.default, ensure_ascii=False)
            text += f"{indent}// Default: {value}\n"
        return f"{text}{indent}{self.name}{'?' if self.optional else ''}: {self.type.ts(indent)}"


class _Object(_Type):
    def __init__(self, schema: dict[str, Any], defs: _Defs) -> None:
        super().__init__(schema)
        self.fields: list[_Field] = []
        self.extra: Any = None
        if not schema:
            return
        defs.schemas.update(schema.get("$defs") or {})
        self.extra = schema.get("additionalProperties")
        if isinstance(self.extra, dict):
            self.extra = parse(self.extra, defs)
        if "properties" not in schema:
            return
        required = set(schema.get("required", []))
        self.fields = [_Field(name, parse(prop, defs), name not in required,
                              prop.get("default") if isinstance(prop, dict) else None)
                       for name, prop in schema["properties"].items()]

    def ts(self, indent: str = "") -> str:
        inner = indent + INDENT
        order = sorted((f for f in self.fields if not f.optional), key=lambda f: f.name) + \
            sorted((f for f in self.fields if f.optional), key=lambda f: f.name)
        parts = [f.ts(inner) for f in order]
        if self.extra is not None:
            if isinstance(self.extra, _Type):
                extra = self.extra.ts(inner)
            elif isinstance(self.extra, bool):
                extra = "any" if self.extra else "never"
            else:
                raise ValueError(f"unknown additionalProperties {self.extra!r}")
            parts.append(f"{inner}[k: string]: {extra}")
        return "{\n" + ",\n".join(parts) + f"\n{indent}}}" if parts else "{}"


class _Array(_Type):
    def __init__(self, schema: dict[str, Any], defs: _Defs) -> None:
        super().__init__(schema, ("minItems", "maxItems"))
        self.item = parse(schema["items"], defs) if schema.get("items") else _Scalar("any")

    def ts(self, indent: str = "") -> str:
        doc = self.item.doc(indent + INDENT)
        if not doc:
            return f"Array<{self.item.ts(indent)}>"
        return f"Array<\n{doc}{indent}{INDENT}{self.item.ts(indent + INDENT)}\n{indent}>"


class _Enum(_Type):
    def __init__(self, schema: dict[str, Any]) -> None:
        super().__init__(schema)
        self.values = schema["enum"]
        kind = schema.get("type")
        if isinstance(kind, list):
            if len(kind) == 2 and "null" in kind:
                kind = kind[0] if kind[0] != "null" else kind[1]
            elif len(kind) == 1:
                kind = kind[0]
            else:
                raise ValueError(f"enum type {kind} is not supported")
        checks = {"string": str, "number": int | float, "integer": int, "boolean": bool}
        for v in self.values:
            if v is not None and kind in checks and not isinstance(v, checks[kind]):
                raise ValueError(f"enum value {v!r} is not a {kind}")

    def ts(self, indent: str = "") -> str:
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in self.values)


class _AnyOf(_Type):
    def __init__(self, schema: dict[str, Any], defs: _Defs) -> None:
        super().__init__(schema)
        self.options = [parse(s, defs) for s in schema["anyOf"]]

    def ts(self, indent: str = "") -> str:
        return " | ".join(t.ts(indent) for t in self.options)


class _Union(_Type):
    def __init__(self, schema: dict[str, Any]) -> None:
        super().__init__(schema)
        self.names = [UNION_NAMES[t] for t in schema["type"]]  # KeyError: not expressible

    def ts(self, indent: str = "") -> str:
        return " | ".join(self.names)


class _Ref(_Type):
    def __init__(self, schema: dict[str, Any], defs: _Defs) -> None:
        super().__init__(schema)
        ref = schema["$ref"]
        if ref == "#":
            defs.self_ref = True
            self.name = "parameters"
        elif ref.startswith("#/$defs/") and ref.split("/")[-1] in defs.schemas:
            self.name = ref.split("/")[-1]
        else:
            raise ValueError(f"unsupported reference {ref!r}")

    def ts(self, indent: str = "") -> str:
        return self.name


def parse(schema: Any, defs: _Defs) -> _Type:
    if isinstance(schema, bool):
        return _Scalar("any" if schema else "null")
    if "$ref" in schema:
        return _Ref(schema, defs)
    if "anyOf" in schema:
        return _AnyOf(schema, defs)
    if "enum" in schema:
        return _Enum(schema)
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, list):
            return _Union(schema)
        if kind == "object":
            return _Object(schema, defs)
        if kind == "array":
            return _Array(schema, defs)
        return _Scalar(kind, schema)
    if schema == {}:
        return _Scalar("any")
    raise ValueError(f"invalid JSON Schema {schema!r}")


def _function(fn: dict[str, Any]) -> str:
    defs = _Defs()
    params = _Object(fn.get("parameters") or {}, defs)
    interfaces = []
    if defs.self_ref:  # the root becomes an interface so `#` can name it
        body = ",\n".join(f.ts(INDENT) for f in params.fields)
        interfaces.append(f"interface parameters {{{chr(10) + body + chr(10) if body else ''}}}")
    for name, schema in dict(defs.schemas).items():
        described = schema.get("description", "")
        head = comment(described) + "\n" if described else ""
        interfaces.append(f"{head}interface {name} {parse(schema, defs).ts()}")
    name = fn.get("name", "function")
    signature = "parameters" if defs.self_ref else params.ts()
    description = fn.get("description")
    parts = ["\n".join(interfaces), (description and comment(description)) or "",
             f"type {name} = (_: {signature}) => any;"]
    return "\n".join(p for p in parts if p)


def tools_to_typescript(tools: list[dict[str, Any]] | None) -> str | None:
    """The declaration text, "" without function tools, None if a schema is not expressible."""
    if not tools:
        return ""
    try:
        functions = [_function(t["function"]) for t in tools
                     if t.get("type") == "function" and t.get("function")]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
