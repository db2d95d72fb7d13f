"""Values quoted in one-line error messages: short, as a user wrote them."""

from __future__ import annotations


def short(v: object, limit: int = 40) -> str:
    """1000000000, 0.1, 1e+30, inf, true, null, 'twenty', 'a long te...': never a line break."""
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "null"}[v]
    if isinstance(v, int):
        if abs(v) < 10**15:
            return str(v)
        try:
            return f"{v:.6g}"
        except OverflowError:  # beyond a double: 10**400
            return f"an integer of {abs(v).bit_length()} bits"
    r = repr(v)  # escapes line breaks
    return r if len(r) <= limit else r[: limit - 4] + "..." + r[-1]


def one_line(text: str, limit: int = 300) -> str:
    """`text` with line breaks and other unprintable characters escaped, cut to `limit`."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(e: BaseException) -> str:
    """'ValueError: the first line of its message', for a one-line error that quotes another."""
    lines = str(e).strip().splitlines()
    return one_line(f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__)
