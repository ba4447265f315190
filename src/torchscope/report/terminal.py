"""What every terminal table shares: module names that shorten themselves to their column.

rich sizes a table's columns to the console (`COLUMNS`) and would cut a long name at its
end (`encoder.layer.11.attention.out…`), losing the leaf. A `ModuleName` cell tells rich how
wide it could be and, given its column's width, draws `torchscope._util.shorten_name`'s
middle-out form (`encoder…11.attention.output.dense`) instead; `Prose` does the same for
the dotted names inside a sentence (a finding's summary) and folds any other word too long
for its column, so that nothing is cut. `Fitted` sizes a whole table for a narrow console:
name columns keep the room their block index and leaf need, the other columns fold.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from torchscope._util import shorten_name

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult

__all__ = ["ROOT", "Fitted", "ModuleName", "Prose"]

ROOT = "<root>"  # how a table names the model itself (qualified name "")


class ModuleName:
    """A table cell holding a module (or parameter) name, shortened from the middle to fit.

    Args:
        name: the qualified name; `""` is shown as `<root>`.
        indent: spaces before the name (a tree table's depth); never shortened away.
        style: a rich style for the whole cell, e.g. `"dim"`.
    """

    def __init__(self, name: str, *, indent: int = 0, style: str = "") -> None:
        self.name = name or ROOT
        self.indent = indent
        self.style = style

    @property
    def essential(self) -> int:
        """Characters of the name cut to its block indices and leaf (`…11…dense`); a name
        that has to be shortened drops its indent first."""
        parts = self.name.split(".")
        kept = [p for p in parts[:-1] if p.isdigit()] + parts[-1:]
        return min(len(self.name), sum(map(len, kept)) + len(kept))

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        # At its narrowest a name is an ellipsis and its leaf.
        leaf = self.name.rsplit(".", 1)[-1]
        return Measurement(self.indent + min(len(self.name), len(leaf) + 1),
                           self.indent + len(self.name))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(options.max_width, 1)
        indent = self.indent if self.indent + len(self.name) <= width else 0
        yield Text(" " * indent + shorten_name(self.name, width - indent), style=self.style,
                   no_wrap=True, overflow="crop", end="")

    def __str__(self) -> str:
        return " " * self.indent + self.name


# A dotted name inside a sentence, with the punctuation around it: `(encoder.layer.3.fc),`.
_DOTTED = re.compile(r"^(?P<pre>[(\[\"'`]*)(?P<name>[A-Za-z_][\w-]*(?:\.[\w-]+)+)"
                     r"(?P<post>[)\]\"'`,.;:]*)$")


def _fit_word(word: str, width: int) -> str:
    m = _DOTTED.match(word)
    if len(word) <= width or m is None:
        return word
    room = width - len(m["pre"]) - len(m["post"])
    return m["pre"] + shorten_name(m["name"], max(room, 1)) + m["post"]


class Prose:
    """Sentences in a table cell: wrapped at spaces; a dotted name longer than the column is
    shortened from the middle (`shorten_name`), any other over-long word folded, never cut.

    Args:
        parts: `(text, style)` pieces, drawn one after another (`\n` starts a new line).
    """

    def __init__(self, *parts: tuple[str, str]) -> None:
        self.parts = parts

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        lines = "".join(t for t, _ in self.parts).split("\n")
        return Measurement(min(max(len(w) for w in "".join(lines).split() or [""]), 16),
                           max(len(line) for line in lines))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(options.max_width, 1)
        text = Text(overflow="fold", end="")
        for part, style in self.parts:
            fitted = " ".join(_fit_word(w, width) for w in part.split(" "))
            text.append(fitted, style=style)
        yield text


TEXT_MIN = 6  # a text column folds down to this many characters
NUMBER_MAX = 10  # a right-aligned (numeric) column keeps up to this many unfolded


def _words(header: object) -> int:
    return max((len(w) for w in str(header).split()), default=0)


class Fitted:
    """A table fitted to its console's width (`COLUMNS`) without cutting anything.

    When the table is wider than the console, the widest columns give way first (as rich
    does), each down to a floor: a column of `ModuleName`s the room its names need to keep
    their block indices and leaf (`…11…dense`), a right-aligned (numeric) column its widest
    cell (at most `NUMBER_MAX`; its header may fold), any other column `TEXT_MIN`
    characters; text folds across lines rather than ending in an ellipsis. When even the
    floors do not fit, the `optional` columns are left out, in order, and the caption says
    so; past that, rich shares out the shortfall.

    Args:
        table: the table; its columns' width and overflow are set at each render.
        optional: headers of columns that may be left out on a narrow console, first
            left out first.
    """

    def __init__(self, table: Table, optional: Sequence[str] = ()) -> None:
        self.table = table
        self.optional = tuple(optional)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.table)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        t = copy.copy(self.table)
        t.columns = list(self.table.columns)
        for col in t.columns:
            col.width = None
            col.overflow = "fold"
        left_out: list[str] = []
        optional = [c for h in self.optional for c in t.columns if str(c.header) == h]
        while True:
            widths, excess = _fit(t, console, options)
            if excess <= 0 or not optional:
                break
            col = optional.pop(0)
            t.columns.remove(col)
            left_out.append(str(col.header))
        if left_out:
            note = f"({', '.join(left_out)} left out to fit {options.max_width} columns)"
            t.caption = f"{t.caption}\n{note}" if t.caption else note
            t.caption_justify = "left"
        if widths is not None:
            for col, width in zip(t.columns, widths, strict=True):
                col.width = width
        yield t


def _fit(t: Table, console: Console, options: ConsoleOptions) -> tuple[list[int] | None, int]:
    """Column widths for `Fitted` (None: as rich sizes them) and by how many characters they
    still exceed the console."""
    columns = t.columns
    names = [[c for c in col.cells if isinstance(c, ModuleName)] for col in columns]
    cells = [[Measurement.get(console, options, c).maximum for c in col.cells]
             for col in columns]
    widths = [max([*w, _words(col.header), 1]) for w, col in zip(cells, columns, strict=True)]
    # Two characters of padding per column, plus the borders.
    borders = (2 if t.box and t.show_edge else 0) + (len(columns) - 1 if t.box else 0)
    excess = sum(widths) - (options.max_width - 2 * len(columns) - borders)
    if excess <= 0:
        return None, excess
    floors = [min(w, max(c.essential for c in n) if n else
                  min(max(m, default=1), NUMBER_MAX) if col.justify == "right" else TEXT_MIN)
              for w, n, m, col in zip(widths, names, cells, columns, strict=True)]
    while excess > 0:
        above = [i for i, w in enumerate(widths) if w > floors[i]]
        if not above:
            break
        widest = max(above, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1
    return widths, excess
