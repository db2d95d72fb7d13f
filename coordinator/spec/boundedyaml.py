"""YAML text into plain values, bounded in size, depth and alias expansion.

`yaml.safe_load` has no bounds: a 100k-deep document overflows the stack (a
RecursionError in pure Python, a crash under libyaml), and a few lines of
nested aliases ("billion laughs") expand into more values than any encoder
can walk. So the document is built here from the parser's event stream, with
no recursion: every collection, scalar and expanded alias counts as a value,
and the build stops at the first collection nested too deep or the first
value over the budget, before doing the work. Aliases still share one object,
so what is built is never bigger than the text.

Scalars are read as `yaml.safe_load` reads them (YAML 1.1: `1e3` is a string,
`1.0e3` a float); the common ones (text, decimal integers, plain floats, true,
null) without calling its resolver, which would double the time. Unlike
safe_load, a mapping key may appear only once, an alias may not refer to a
collection that contains it, and collections take no tags but the default
ones (no !!set, !!omap, !!pairs). The event parser is libyaml's when PyYAML
was built with it, else PyYAML's: 1 MiB of spec takes 0.1-0.3 s with libyaml,
some 4 times less than yaml.load with libyaml (bench/spec_parse.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import ScalarNode
from yaml.resolver import Resolver

from gpipe.errors import SpecError
from gpipe.show import one_line, short

Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_STR = "tag:yaml.org,2002:str"
_MERGE = "tag:yaml.org,2002:merge"
_SEQ = "tag:yaml.org,2002:seq"
_MAP = "tag:yaml.org,2002:map"
_SCALAR_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float", "binary", "timestamp", "str")}
# The first characters of a plain scalar that may be a bool, int, float, null ... (the safe
# resolver has none for any first character; a fuzz test holds this loader to yaml.load).
_RESOLVED_FIRST = frozenset(Resolver.yaml_implicit_resolvers)
# Plain scalars that int(), float() or a look-up read as safe_load does, without its resolver.
_DECIMAL = re.compile(r"[-+]?(?:0|[1-9][0-9]{0,17})\Z")
_FLOAT = re.compile(r"(?:[-+]?[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+][0-9]+)?\Z")
_LITERALS: dict[str, bool | None] = {
    **{w: True for t in ("yes", "true", "on") for w in (t, t.title(), t.upper())},
    **{w: False for f in ("no", "false", "off") for w in (f, f.title(), f.upper())},
    **{w: None for w in ("", "~", "null", "Null", "NULL")},
}
_UNSET = object()  # a scalar not read yet
_NO_KEY = object()  # a mapping waiting for its next key
_MERGE_KEY = object()  # the key `<<`: merge the value's mapping(s) into this one


class _Collection:
    """A sequence or mapping being built."""

    __slots__ = ("value", "anchor", "depth", "deepest", "first_node", "key", "merges", "mark")

    def __init__(self, value: list[Any] | dict[Any, Any], anchor: str | None, depth: int,
                 first_node: int, mark: Any):
        self.value = value
        self.anchor, self.depth, self.deepest, self.first_node, self.mark = anchor, depth, depth, first_node, mark
        self.key: Any = _NO_KEY
        self.merges: list[dict[Any, Any]] = []


class _Anchored:
    __slots__ = ("value", "nodes", "levels")

    def __init__(self, value: Any, nodes: int, levels: int):
        self.value, self.nodes, self.levels = value, nodes, levels


def _where(mark: Any) -> str:
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def check_text(text: object, source: str, max_bytes: int) -> str:
    """`text` if it is a str of at most `max_bytes` UTF-8 bytes, else SpecError."""
    if not isinstance(text, str):
        raise SpecError(f"{source}: expected YAML text, got {type(text).__name__}")
    if (n := len(text.encode("utf-8", "surrogatepass"))) > max_bytes:
        raise SpecError(f"{source}: {n} bytes is over the {_size(max_bytes)} limit")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpecError(f"{source}: not valid text: a lone surrogate at character {e.start}") from None
    return text


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n} bytes"


def load(text: object, *, source: str, max_bytes: int, max_depth: int, max_nodes: int) -> Any:
    """The one document in `text`, or SpecError with one line saying what is wrong and where.

    At most `max_bytes` of UTF-8, collections nested at most `max_depth` deep
    (the top-level mapping is level 1) and at most `max_nodes` values once
    every alias is expanded.
    """
    checked = check_text(text, source, max_bytes)
    try:
        return _build(checked, source, max_depth, max_nodes)
    except SpecError:
        raise
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if "maximum nesting depth" in problem:  # libyaml's own cap (PyYAML >= 6.0.4), met while it scans ahead
            raise SpecError(f"{source}: nested deeper than {max_depth} levels") from None
        raise SpecError(f"{source}: not valid YAML{_where(mark)}: {one_line(problem)}") from None
    except (ValueError, TypeError, RecursionError, MemoryError) as e:  # none expected: bounded above
        raise SpecError(f"{source}: not valid YAML: {type(e).__name__}") from None


def _build(text: str, source: str, max_depth: int, max_nodes: int) -> Any:
    # The resolver has no annotations: typed here, where it is taken.
    resolve: Callable[[type[ScalarNode], str, tuple[bool, bool]], str] = Resolver().resolve
    constructor = SafeConstructor()
    anchors: dict[str, _Anchored] = {}
    open_anchors: set[str] = set()
    stack: list[_Collection] = []
    nodes = documents = 0
    root: Any = None

    def fail(mark: Any, problem: str) -> SpecError:
        return SpecError(f"{source}: not valid YAML{_where(mark)}: {problem}")

    def new_anchor(name: str, mark: Any) -> None:
        if name in anchors or name in open_anchors:
            raise fail(mark, f"found duplicate anchor {short(name)}")

    def too_many() -> SpecError:
        return SpecError(f"{source}: more than {max_nodes} values once aliases are expanded")

    parser = Loader(text)
    try:
        events = iter(parser.get_event, None)  # get_event, not yaml.parse: a third faster
        for ev in events:
            mark = ev.start_mark
            value: Any
            if isinstance(ev, yaml.ScalarEvent):
                nodes += 1
                if nodes > max_nodes:
                    raise too_many()
                tag, text, value = ev.tag, ev.value, _UNSET
                if tag is None or tag == "!":  # resolve's answer, without calling it for most scalars
                    if not ev.implicit[0] or (text and text[0] not in _RESOLVED_FIRST):
                        value = text  # quoted; or plain, and no implicit type starts so
                    elif text in _LITERALS:
                        value = _LITERALS[text]
                    elif _DECIMAL.match(text):
                        value = int(text)
                    elif _FLOAT.match(text):
                        value = float(text)
                    else:
                        tag = resolve(ScalarNode, text, ev.implicit)
                if value is not _UNSET:
                    pass
                elif tag == _STR:
                    value = text
                elif tag == _MERGE and stack and stack[-1].key is _NO_KEY and isinstance(stack[-1].value, dict):
                    value = _MERGE_KEY
                elif tag in _SCALAR_TAGS:
                    try:
                        value = SafeConstructor.yaml_constructors[tag](
                            constructor, ScalarNode(tag, ev.value))
                    except (ValueError, OverflowError, yaml.YAMLError) as e:  # 2020-13-01; 5000 digits; !!binary ?
                        why = one_line(getattr(e, "problem", None) or str(e).split(";")[0])
                        raise fail(mark, f"cannot read {short(ev.value)} as {tag.rsplit(':', 1)[-1]}: {why}") from None
                else:
                    raise fail(ev.start_mark, f"unsupported tag {short(tag)}")
                if ev.anchor is not None:
                    new_anchor(ev.anchor, ev.start_mark)
                    anchors[ev.anchor] = _Anchored(value, 1, 0)
            elif isinstance(ev, yaml.CollectionStartEvent):
                nodes += 1
                if nodes > max_nodes:
                    raise too_many()
                if len(stack) >= max_depth:
                    raise SpecError(f"{source}: nested deeper than {max_depth} levels")
                seq = isinstance(ev, yaml.SequenceStartEvent)
                if ev.tag not in (None, "!", _SEQ if seq else _MAP):
                    raise fail(ev.start_mark, f"unsupported tag {short(ev.tag)}")
                if ev.anchor is not None:
                    new_anchor(ev.anchor, ev.start_mark)
                    open_anchors.add(ev.anchor)
                stack.append(_Collection([] if seq else {}, ev.anchor, len(stack) + 1, nodes, ev.start_mark))
                continue
            elif isinstance(ev, yaml.CollectionEndEvent):
                done = stack.pop()
                if done.merges:
                    assert isinstance(done.value, dict)
                    merged: dict[Any, Any] = {}
                    for m in done.merges:
                        merged.update(m)
                    merged.update(done.value)
                    done.value = merged
                value, mark = done.value, done.mark
                if stack:
                    stack[-1].deepest = max(stack[-1].deepest, done.deepest)
                if done.anchor is not None:
                    open_anchors.discard(done.anchor)
                    anchors[done.anchor] = _Anchored(value, nodes - done.first_node + 1, done.deepest - done.depth + 1)
            elif isinstance(ev, yaml.AliasEvent):
                if ev.anchor in open_anchors:
                    raise fail(ev.start_mark, f"alias {short(ev.anchor)} refers to a collection that contains it")
                target = anchors.get(ev.anchor or "")
                if target is None:
                    raise fail(ev.start_mark, f"found undefined alias {short(ev.anchor)}")
                nodes += target.nodes
                if nodes > max_nodes:
                    raise too_many()
                if len(stack) + target.levels > max_depth:
                    raise SpecError(f"{source}: nested deeper than {max_depth} levels")
                if stack:
                    stack[-1].deepest = max(stack[-1].deepest, len(stack) + target.levels)
                value = target.value
            elif isinstance(ev, yaml.DocumentStartEvent):
                documents += 1
                if documents > 1:
                    raise fail(ev.start_mark, "expected a single document in the stream")
                continue
            else:
                continue
            if not stack:
                root = value
            elif type(top := stack[-1].value) is list:
                top.append(value)
            elif (key := stack[-1].key) is _NO_KEY:
                if type(value) is str and value not in top:  # a new key, most often
                    stack[-1].key = value
                else:
                    _add(stack[-1], value, mark, fail)
            elif key is not _MERGE_KEY:  # a key's value
                top[key] = value
                stack[-1].key = _NO_KEY
            else:
                _add(stack[-1], value, mark, fail)
    finally:
        parser.dispose()
    return root


def _add(parent: _Collection, value: Any, mark: Any, fail: Callable[[Any, str], SpecError]) -> None:
    """Put `value` into the collection being built: an item, a key, or a key's value."""
    c = parent.value
    if isinstance(c, list):
        c.append(value)
        return
    key = parent.key
    if key is _NO_KEY:
        if isinstance(value, (list, dict)) or not isinstance(value, Hashable):
            raise fail(mark, "a mapping key must be a scalar")
        if value is not _MERGE_KEY and value in c:
            raise fail(mark, f"duplicate key {short(value)}")
        parent.key = value
        return
    parent.key = _NO_KEY
    if key is _MERGE_KEY:
        if isinstance(value, dict):
            parent.merges.append(value)
        elif isinstance(value, list) and all(isinstance(m, dict) for m in value):
            parent.merges.extend(reversed(value))  # the first mapping listed wins
        else:
            raise fail(mark, "expected a mapping or list of mappings for merging")
        return
    c[key] = value
