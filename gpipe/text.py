"""Strings from outside (a request, a log file) made safe for one log line."""

from __future__ import annotations


def printable(s: str, limit: int = 256) -> str:
    """`s` in one line: control, format and line-breaking characters escaped, cut to `limit` characters.

    `\\n`, `\\x1b` and `\\u2028` come out as those escapes, so whatever a caller
    sends cannot forge a log line or move a terminal's cursor. A cut string
    ends in `...`. Escaping twice changes nothing.
    """
    out: list[str] = []
    size = 0
    for ch in s:
        e = ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
        if size + len(e) > limit:
            out.append("...")
            break
        out.append(e)
        size += len(e)
    return "".join(out)
