"""A job file's fields overridden on the command line: `--set chunks=8 --set optimizer.lr=3e-4`, `--name NAME`.

Each `--set PATH=VALUE` replaces one value of the job file's mapping before the spec is validated: PATH is
dotted field names (a list's index as a number: balance.1), VALUE is YAML (`data.args={n: 64}`, `eval=null`).
A mapping missing on the way is made (lr_schedule.name=cosine on a job without one), so the schema's own
line names whatever is then wrong, an unknown field included. The result is the job's text from then on: what
`run` records in its output folder and its attempts read, and what `submit` sends.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from gpipe.coordinator.spec import boundedyaml
from gpipe.coordinator.spec.job import MAX_DEPTH, MAX_NODES, MAX_SPEC_BYTES
from gpipe.errors import SpecError

# A number YAML 1.1 reads as text (3e-4: no dot before the exponent), which YAML 1.2 and the command line mean
# as a number.
EXPONENT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def apply(text: str, sets: list[str], name: str | None, source: str) -> str:
    """`text` (a job file's) with each of `sets` ('PATH=VALUE') applied in order, then the name `name`; as it
    was when there are none. SpecError, one line, naming the --set item, for what cannot be applied."""
    if not sets and name is None:
        return text
    raw = boundedyaml.load(text, source=source, max_bytes=MAX_SPEC_BYTES, max_depth=MAX_DEPTH, max_nodes=MAX_NODES)
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(raw).__name__}")
    raw = _unshared(raw)  # a YAML alias (eval: {data: *d}) is its own copy: --set changes the one path it names
    for item in sets:
        path, value = _parse(item)
        _put(raw, path, value, item)
    if name is not None:
        raw["name"] = name
    return yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)


def _unshared(v: Any) -> Any:
    """`v` with every mapping and list its own object: YAML's aliases load as one object used twice, which a
    --set through one path would change at both (and which safe_dump writes back as an alias). Bounded: the
    loader counted the expanded nodes (MAX_NODES)."""
    if isinstance(v, dict):
        return {k: _unshared(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_unshared(x) for x in v]
    return v


def _parse(item: str) -> tuple[list[str], Any]:
    path, eq, text = item.partition("=")
    keys = path.strip().split(".")
    if not eq or not all(k.strip() for k in keys):
        raise SpecError(f"--set {item}: expected PATH=VALUE, PATH a dotted field path (optimizer.lr=3e-4)")
    value = boundedyaml.load(text, source=f"--set {path.strip()}", max_bytes=MAX_SPEC_BYTES, max_depth=MAX_DEPTH,
                             max_nodes=MAX_NODES)
    if isinstance(value, str) and EXPONENT.match(value):
        value = float(value)
    return [k.strip() for k in keys], value


def _put(raw: dict[str, Any], keys: list[str], value: Any, item: str) -> None:
    node: Any = raw
    for depth, key in enumerate(keys):
        where = ".".join(keys[:depth]) or "the job"
        last = depth == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise SpecError(f"--set {item}: {where} is a list of {len(node)}; {key!r} is not an index in it")
            index: int | str = int(key)
        elif isinstance(node, dict):
            index = key
            if not last and node.get(key) is None:
                node[key] = {}  # made on the way: the schema names what it lacks or does not know
        else:
            raise SpecError(f"--set {item}: {where} is {_kind(node)}, not a mapping with field {key!r}")
        if last:
            node[index] = value
        else:
            node = node[index]


def _kind(v: Any) -> str:
    if v is None or isinstance(v, bool):
        return str(v).lower() if v is not None else "null"
    return "text" if isinstance(v, str) else "a number" if isinstance(v, int | float) else f"a {type(v).__name__}"
