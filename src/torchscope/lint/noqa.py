"""`# noqa` comments: a bare `# noqa` silences every rule on its line, `# noqa: TS001` one."""

from __future__ import annotations

import io
import re
import tokenize

__all__ = ["noqa_map", "suppressed"]

_NOQA = re.compile(
    r"#\s*noqa(?P<colon>\s*:\s*(?P<codes>[A-Za-z]+[0-9]+(?:[\s,]+[A-Za-z]+[0-9]+)*))?",
    re.IGNORECASE,
)


def _comments(source: str) -> list[tuple[int, str]]:
    try:
        return [(tok.start[0], tok.string)
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        # Fall back to a plain scan; a stray '#' inside a string may then count.
        return [(i, line[line.index("#"):]) for i, line in enumerate(source.splitlines(), 1)
                if "#" in line]


def noqa_map(source: str) -> dict[int, frozenset[str] | None]:
    """`{line: codes}` for every noqa comment; None means a bare `# noqa` (all codes)."""
    out: dict[int, frozenset[str] | None] = {}
    for line, text in _comments(source):
        match = _NOQA.search(text)
        if match is None:
            continue
        codes = match.group("codes")
        if codes is None:
            out[line] = None
        else:
            found = frozenset(c.upper() for c in re.split(r"[\s,]+", codes.strip()) if c)
            prev = out.get(line, frozenset())
            out[line] = None if prev is None else prev | found
    return out


def suppressed(noqa: dict[int, frozenset[str] | None], code: str, lines: tuple[int, ...]
               ) -> bool:
    """Whether a finding of `code` spanning `lines` is silenced by a noqa comment.

    Args:
        noqa: line number -> the codes its `# noqa:` names, or None for a bare `# noqa`.
        code: the finding's rule code.
        lines: the line numbers the finding spans.
    """
    return any((codes := noqa.get(line, frozenset())) is None or code in codes for line in lines)
