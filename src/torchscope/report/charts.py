"""What every plot of the report shares (matplotlib `Figure`s, never pyplot, so the user's
backend is left alone).

- `module_chart` / `draw_rows`: the one way to draw a number per module: horizontal rows
  with the full module names, grouped by block (`encoder.layer.3.*` headers on shaded bands),
  sized so that no label and no title is cut; `block_groups` says which modules form a block
  and `DEEP_ROWS` when a model is summarised per block first.
- `EmptyPlot`: a figure that only says why there is nothing to draw; report.html shows that
  line instead of an empty chart.
- `figure_svg`: a figure as a self-contained inline `<svg>` whose element ids carry a prefix
  (unique across the page), every category label tagged `label:<text>` (`tag_labels`) for
  tests and tools.
"""

from __future__ import annotations

import io
import math
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from matplotlib.figure import Figure

from torchscope._util import module_block

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.text import Text

__all__ = [
    "ACCENT",
    "ACCENT2",
    "DEEP_ROWS",
    "GREY",
    "WARN",
    "EmptyPlot",
    "Series",
    "block_groups",
    "block_label",
    "chart_figure",
    "chart_size",
    "draw_rows",
    "figure_svg",
    "label_texts",
    "label_width",
    "module_chart",
    "set_title",
    "tag_labels",
    "wrap",
]

ACCENT = "#3b6ea8"
ACCENT2 = "#d9822b"
WARN = "#c0392b"
GREY = "#777777"
DEEP_ROWS = 48  # more modules than this: a per-block summary first, the full list collapsed
FONT = 8.0  # points, labels; titles are one point larger
_CHAR_IN = 0.068  # mean width of a DejaVu Sans character at 8 pt, in inches (upper bound)
_ROW_IN = 0.2  # height of one row
_BAND = "#eef2f7"
_RC: dict[str, Any] = {"font.size": FONT, "svg.fonttype": "path", "svg.hashsalt": "torchscope",
                       "axes.spines.top": False, "axes.spines.right": False}
LABEL_GID = "label:"


@dataclass(frozen=True)
class Series:
    """One thing drawn on every row of a module chart.

    Attributes:
        label: its legend entry.
        values: one per row; NaN draws nothing on that row.
        kind: `bar` (from `start`, else from zero), `point` (with `err` as ± whiskers) or
            `range` (a thin line from `start` to the value).
        color: the colour; `colors` overrides it per row.
        start: where each bar or range begins (stacked bars, ranges).
        err: ± half-widths around each point.
        colors: one colour per row.
        marker: the point marker.
        notes: a short text drawn right of each row's value ("3/8 dead"), "" for none.
        note_colors: one colour per note (default: the warning colour).
    """

    label: str
    values: Sequence[float]
    kind: Literal["bar", "point", "range"] = "bar"
    color: str = ACCENT
    start: Sequence[float] | None = None
    err: Sequence[float] | None = None
    colors: Sequence[str] | None = None
    marker: str = "o"
    notes: Sequence[str] | None = None
    note_colors: Sequence[str] | None = None


class EmptyPlot(Figure):
    """A figure with nothing to draw, and why (`reason`, one sentence).

    report.html shows the reason instead of a chart; saved as a file it is a figure with
    the reason written in it.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(figsize=(6.0, 0.8))
        self.reason = reason
        self.text(0.02, 0.5, textwrap.fill(reason, 90), va="center", fontsize=FONT)


def block_groups(names: Sequence[str]) -> list[tuple[str, list[int]]]:
    """Consecutive runs of `names` in the same block (`torchscope._util.module_block`), in
    order: `(block, indices)`. A block that comes back after another one starts a new run."""
    groups: list[tuple[str, list[int]]] = []
    for i, name in enumerate(names):
        block = module_block(name)
        if groups and groups[-1][0] == block:
            groups[-1][1].append(i)
        else:
            groups.append((block, [i]))
    return groups


def block_label(block: str, names: Sequence[str]) -> str:
    """How a chart or table names a block: `encoder.layer.3.*`, or the module's own name
    when the block is that one module."""
    if len(names) == 1 and names[0] == block:
        return block or "<root>"
    return f"{block}.*"


@dataclass(frozen=True)
class _Row:
    label: str
    index: int | None  # into the data; None for a block header


def _rows(names: Sequence[str], group: bool) -> list[_Row]:
    if not group:
        return [_Row(n or "<root>", i) for i, n in enumerate(names)]
    rows: list[_Row] = []
    for block, idx in block_groups(names):
        if len(idx) > 1 and block:
            rows.append(_Row(block_label(block, [names[i] for i in idx]), None))
        rows.extend(_Row(names[i] or "<root>", i) for i in idx)
    return rows


def wrap(text: str, width_in: float, size: float = FONT + 1) -> str:
    """`text` wrapped to lines that fit `width_in` inches at `size` points."""
    chars = max(int(width_in / (_CHAR_IN * size / FONT)), 16)
    return textwrap.fill(text, chars)


def chart_size(labels: Sequence[str], rows: int, *, min_width: float = 7.0,
               extra_height: float = 1.5) -> tuple[float, float]:
    """(width, height) in inches for `rows` horizontal rows labelled `labels`: wide enough
    for the longest label plus a 5-inch plot (at most 12), tall enough for every row."""
    return min(max(min_width, label_width(labels) + 5.5), 12.0), rows * _ROW_IN + extra_height


def label_width(labels: Sequence[str]) -> float:
    """Inches the longest of `labels` takes at the label size (an upper bound)."""
    return max((len(t) for t in labels), default=8) * _CHAR_IN


def chart_figure(labels: Sequence[str], rows: int) -> tuple[Figure, Axes]:
    """A figure of `chart_size` and its one axes."""
    fig = Figure(figsize=chart_size(labels, rows), layout="constrained")
    return fig, fig.add_subplot()


def set_title(fig: Figure, text: str) -> None:
    """A left-aligned figure title, wrapped to the figure's width (never clipped)."""
    width = fig.get_figwidth()
    fig.suptitle(wrap(text, width - 0.3), x=0.01, ha="left", fontsize=FONT + 1)


def draw_rows(ax: Axes, names: Sequence[str], series: Sequence[Series], *, group: bool = True,
              log: bool = False, xlabel: str = "", ref: float | None = None) -> None:
    """Draw `series` on one horizontal row per name, the first at the top.

    Args:
        ax: the axes.
        names: the row labels in order (module names in full; `""` is `<root>`).
        series: what to draw on each row.
        group: group modules of one block under a bold `block.*` header on a shaded band.
        log: a logarithmic value axis (only when some value is positive).
        xlabel: the value axis' label.
        ref: a dashed reference line at this value (1× speedup, say).
    """
    rows = _rows(names, group)
    ys = {r.index: y for y, r in enumerate(rows) if r.index is not None}
    at = [ys[i] for i in range(len(names))]
    if group:
        for k, (_, idx) in enumerate(block_groups(names)):
            if k % 2:
                top = min(ys[i] for i in idx) - (1 if len(idx) > 1 else 0)
                ax.axhspan(top - 0.5, max(ys[i] for i in idx) + 0.5, color=_BAND, zorder=0)
    for s in series:
        _draw(ax, at, s)
    if ref is not None:
        ax.axvline(ref, color="#555555", linestyle="--", linewidth=1)
    positive = [v for s in series for v in s.values if math.isfinite(v) and v > 0]
    if log and positive:
        ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), [r.label for r in rows], fontsize=FONT)
    for r, text in zip(rows, ax.get_yticklabels(), strict=True):
        if r.index is None:
            text.set_fontweight("bold")
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.tick_params(axis="x", labelsize=FONT)
    ax.set_xlabel(xlabel, fontsize=FONT)
    ax.grid(True, axis="x", alpha=0.3, which="both" if log else "major")
    if len(series) > 1:  # above the plot, where it covers no row
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=len(series),
                  fontsize=FONT - 1, frameon=False, borderaxespad=0.2)


def _draw(ax: Axes, ys: list[int], s: Series) -> None:
    vals = [float(v) for v in s.values]
    colors = list(s.colors) if s.colors is not None else s.color
    if s.kind == "bar":
        left = [float(v) for v in s.start] if s.start is not None else None
        ax.barh(ys, vals, left=left, color=colors, height=0.7, label=s.label, zorder=2)
    elif s.kind == "range":
        lo = [float(v) for v in s.start] if s.start is not None else [0.0] * len(vals)
        ax.hlines(ys, lo, vals, colors=colors, linewidth=1.2, label=s.label, zorder=2)
    else:
        err = [float(e) for e in s.err] if s.err is not None else None
        ax.errorbar(vals, ys, xerr=err, fmt=s.marker, color=s.color, markersize=3.5,
                    elinewidth=1, capsize=2, label=s.label, zorder=3, linestyle="none")
    note_colors = list(s.note_colors or [WARN] * len(vals))
    for y, v, note, color in zip(ys, vals, s.notes or (), note_colors, strict=False):
        if note and math.isfinite(v):
            ax.annotate(note, (v, y), xytext=(3, 0), textcoords="offset points", va="center",
                        fontsize=FONT - 1, color=color)


def module_chart(names: Sequence[str], series: Sequence[Series], *, title: str,
                 xlabel: str = "", group: bool = True, log: bool = False,
                 ref: float | None = None) -> Figure:
    """One figure of `draw_rows`: full names, one row each, grouped by block; titled."""
    rows = _rows(names, group)
    fig, ax = chart_figure([r.label for r in rows], len(rows))
    draw_rows(ax, names, series, group=group, log=log, xlabel=xlabel, ref=ref)
    set_title(fig, title)
    return fig


def tag_labels(fig: Figure) -> None:
    """Give the texts a reader relies on an SVG id that says what they are: each category
    label (tick labels set from names, not numbers) `label:<text>` (spaces as `_`, a repeat
    suffixed `~2`, `~3`, ...), the figure's title `title` and each axes' title `title-<i>`."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, FuncFormatter

    # matplotlib keeps the titles' Text objects in these attributes (no public getter).
    suptitle = getattr(fig, "_suptitle", None)
    if suptitle is not None and not suptitle.get_gid():
        suptitle.set_gid("title")
    used: set[str] = set()
    for i, ax in enumerate(fig.axes):
        for where in ("title", "_left_title", "_right_title"):
            title = getattr(ax, where, None)
            if title is not None and title.get_text() and not title.get_gid():
                title.set_gid(f"title-{i}")
        for axis, texts in ((ax.xaxis, ax.get_xticklabels()), (ax.yaxis, ax.get_yticklabels())):
            # Ticks set from names: fixed positions, each labelled by a lookup (which
            # formatter matplotlib uses for that depends on its version).
            if not isinstance(axis.get_major_locator(), FixedLocator) or not isinstance(
                    axis.get_major_formatter(), (FixedFormatter, FuncFormatter)):
                continue
            for text in texts:
                if not text.get_text() or text.get_gid():
                    continue
                gid = LABEL_GID + re.sub(r"\s", "_", text.get_text())
                k, unique = 1, gid
                while unique in used:
                    k += 1
                    unique = f"{gid}~{k}"
                used.add(unique)
                text.set_gid(unique)


def label_texts(fig: Figure) -> list[Text]:
    """Every text of `fig` tagged as a label (`tag_labels`, plus any tagged by hand such as
    the checkpoint plans' legend entries)."""
    from matplotlib.text import Text

    tag_labels(fig)
    return [t for t in fig.findobj(Text)
            if isinstance(t, Text) and str(t.get_gid() or "").startswith(LABEL_GID)]


_ID = re.compile(r'\bid="([^"]+)"')
_REF = re.compile(r'(href="#|url\(#)([^")]+)')


def figure_svg(fig: Figure, prefix: str = "") -> str:
    """The figure as an inline `<svg>` element: no XML prolog, DOCTYPE, metadata or comments,
    glyphs as paths (no font needed), and every element id (with every reference to it)
    prefixed `<prefix>-`, so that several figures share one page without clashing ids."""
    import matplotlib

    tag_labels(fig)
    buf = io.StringIO()
    with matplotlib.rc_context(_RC):  # type: ignore[arg-type]
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None,
                                                 "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r"<!--.*?-->", "", svg, flags=re.S)
    if prefix:
        svg = _ID.sub(lambda m: f'id="{prefix}-{m.group(1)}"', svg)
        svg = _REF.sub(lambda m: f"{m.group(1)}{prefix}-{m.group(2)}", svg)
    return svg.strip()
