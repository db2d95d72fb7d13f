"""docs/spec.md: the job spec reference, written from the pydantic schema (a test fails when it is stale).

    python -m gpipe.coordinator.spec.job --markdown > docs/spec.md
"""

from __future__ import annotations

import json
from typing import Any

from gpipe.coordinator.spec.job import JobSpec

HEAD = """# The job spec reference

Every field of `job.yaml`, with its default, its range and what it does. This
page is generated from the schema in `coordinator/spec/job.py`
(`python -m gpipe.coordinator.spec.job --markdown > docs/spec.md`; a test fails
when it is stale). What the fields mean together, and the limits on a spec's
text, are in [the job spec, explained](job-spec.md).

An unknown field is an error naming it (with the field it is closest to), and
so is a value out of range; a bad spec is one line and exit 2, before anything
starts.
"""


def _type(p: dict[str, Any], defs: dict[str, Any]) -> str:
    """A property's type in a few words: integer 1..64, 'gpipe' | '1f1b', list of integer, a section."""
    if "$ref" in p:
        return f"[{_name(p['$ref'])}](#{_anchor(_name(p['$ref']))})"
    if "anyOf" in p or "oneOf" in p:
        kinds = [_type(x, defs) for x in p.get("anyOf", p.get("oneOf", []))]
        return " or ".join(k for k in kinds if k != "null") + (" or null" if "null" in kinds else "")
    if "enum" in p:
        return " \\| ".join(f"`{v}`" for v in p["enum"])
    if "const" in p:
        return f"`{p['const']}`"
    t = str(p.get("type", "any"))
    if t == "array":
        items = p.get("items") or p.get("prefixItems")
        inner = ", ".join(_type(i, defs) for i in items) if isinstance(items, list) else _type(items or {}, defs)
        n = "" if "maxItems" not in p or isinstance(items, list) else f", at most {p['maxItems']}"
        return f"list of {inner}{n}" if not isinstance(items, list) else f"[{inner}]"
    if t == "object":
        return "mapping"
    lo = p.get("minimum", p.get("exclusiveMinimum"))
    hi = p.get("maximum", p.get("exclusiveMaximum"))
    if lo is None and hi is None:
        return t
    left = "(" if "exclusiveMinimum" in p else "["
    right = ")" if "exclusiveMaximum" in p else "]"
    return f"{t} in {left}{_num(lo)}, {_num(hi)}{right}"


def _num(x: float | None) -> str:
    if x is None:
        return "∞"
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _name(ref: str) -> str:
    return str(ref).rsplit("/", 1)[-1]


def _anchor(name: str) -> str:
    return name.lower()


def _default(p: dict[str, Any], required: bool) -> str:
    if required:
        return "required"
    if "default" not in p:
        return "its section's"
    return f"`{json.dumps(p['default'])}`"


def _table(schema: dict[str, Any], defs: dict[str, Any], prefix: str) -> list[str]:
    rows = ["| field | default | type | what |", "| --- | --- | --- | --- |"]
    required = set(schema.get("required", []))
    for name, p in schema.get("properties", {}).items():
        desc = " ".join(str(p.get("description", "")).split()).replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | {_default(p, name in required)} | {_type(p, defs)} | {desc} |")
    return rows


def markdown() -> str:
    """The reference: the job's fields, then each section's."""
    schema = JobSpec.model_json_schema()
    defs = schema.get("$defs", {})
    out = [HEAD, f"## {schema.get('title', 'JobSpec')}", "", " ".join(str(schema.get("description", "")).split()),
           "", *_table(schema, defs, "")]
    for name in sorted(defs):
        d = defs[name]
        out += ["", f"## {name}", ""]
        if d.get("description"):
            out += [" ".join(str(d["description"]).split()), ""]
        out += _table(d, defs, "")
    return "\n".join(out) + "\n"
