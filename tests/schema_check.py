"""A JSON Schema check for the subset the structured-output tests use (object, properties,
required, additionalProperties, array items, enum, string/integer/number/boolean, maxLength,
minimum, maximum): returns the first violation, or None."""

from __future__ import annotations

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def violation(value, schema: dict, path: str = "$") -> str | None:
    kind = schema.get("type")
    if kind in ("integer", "number"):
        ok = isinstance(value, int if kind == "integer" else (int, float)) and not isinstance(value, bool)
        if not ok:
            return f"{path}: {value!r} is not {kind}"
        if "minimum" in schema and value < schema["minimum"] or "maximum" in schema and value > schema["maximum"]:
            return f"{path}: {value} out of range"
    elif kind is not None and not isinstance(value, _TYPES[kind]):
        return f"{path}: {value!r} is not {kind}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: {value!r} not in {schema['enum']}"
    if kind == "string" and len(value) > schema.get("maxLength", len(value)):
        return f"{path}: longer than {schema['maxLength']}"
    if kind == "array":
        return next((v for i, item in enumerate(value)
                     if (v := violation(item, schema.get("items", {}), f"{path}[{i}]"))), None)
    if kind == "object":
        props = schema.get("properties", {})
        missing = [k for k in schema.get("required", []) if k not in value]
        if missing:
            return f"{path}: missing {missing}"
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return f"{path}: extra {sorted(set(value) - set(props))}"
        return next((v for k, item in value.items() if k in props
                     if (v := violation(item, props[k], f"{path}.{k}"))), None)
    return None
