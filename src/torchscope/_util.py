"""Neutral helpers every layer may use: number formatting for messages and tables,
turning records into JSON-ready data, and the line fit that trend findings share.

This module imports nothing from torchscope, so analyzers (which word their findings with
`fmt_bytes`) and renderers (which print tables) share one formatter without an analyzer
depending on a renderer.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "fit_line",
    "fmt_bytes",
    "fmt_names",
    "fmt_num",
    "fmt_pct",
    "fmt_shape",
    "fmt_times",
    "frozen_record",
    "is_norm_type",
    "module_block",
    "output_problem",
    "shorten_name",
    "to_jsonable",
    "write_json",
]

ELLIPSIS = "…"

_T = TypeVar("_T")
_new = object.__new__
_set_attr = object.__setattr__


def frozen_record(cls: type[_T], fields: dict[str, Any]) -> _T:
    """An instance of dataclass `cls` (frozen, without `__slots__` or `__post_init__`)
    whose fields are `fields`, every one of them in declaration order: the object its
    `__init__` would make, built in a third to a half of the time. A frozen dataclass's
    `__init__` sets each field through `object.__setattr__` (1 to 3 µs a record); hooks'
    records, built by the thousand per sampled step, are made this way. Their tests compare
    each with one made by `__init__`."""
    obj = _new(cls)
    _set_attr(obj, "__dict__", fields)
    return obj


def fmt_num(x: float | None, digits: int = 4) -> str:
    """Compact number: `0.0021`, `2.8e+02`, `nan`, `inf`, or `—` for None."""
    if x is None:
        return "—"
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.{digits}g}"
    return f"{x:.{max(digits - 2, 1)}e}"


def fmt_pct(frac: float | None) -> str:
    """A fraction as a percentage: `41.2%`."""
    return "—" if frac is None or not math.isfinite(frac) else f"{100 * frac:.1f}%"


def fmt_names(names: Sequence[str], shown: int = 3) -> str:
    """The first `shown` names, then how many more: `a, b, c and 4 more`."""
    rest = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {rest} more" if rest > 0 else "")


def common_parent(names: Sequence[str]) -> str:
    """The deepest module containing every one of `names` ("" for the root)."""
    split = [n.split(".") if n else [] for n in names]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def fmt_times(ratio: float) -> str:
    """A ratio as a factor: `1.5×`, `32×`, `4.7e33×` (a collapse spans many orders)."""
    if ratio >= 1e4:
        return f"{ratio:.1e}×".replace("e+0", "e").replace("e+", "e")
    return f"{ratio:.0f}×" if ratio >= 10 else f"{ratio:.1f}×"


def fmt_bytes(n: float | None) -> str:
    """Bytes in binary units: `8.0 KiB`, `1.5 MiB`."""
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def fmt_shape(shape: tuple[int, ...]) -> str:
    """`(32, 8, 30, 30)`."""
    return "(" + ", ".join(map(str, shape)) + ")"


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares line through the points: (slope, R²).

    R² is the share of the variance of `ys` the line explains: 1 when the points lie on it,
    0 when they scatter around a flat line (and for flat or fewer than two points, whose
    slope is 0 too).
    """
    n = len(xs)
    if n < 2:
        return 0.0, 0.0
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    syy = math.fsum((y - my) ** 2 for y in ys)
    if sxx == 0:
        return 0.0, 0.0
    return sxy / sxx, (sxy * sxy / (sxx * syy) if syy > 0 else 0.0)


# A normalization layer by its class name, torch's and the model libraries' own (`BatchNorm2d`,
# `LlamaRMSNorm`, `T5LayerNorm`, `ConvNextLayerNorm`); not MobileBERT's `NoNorm`, an
# elementwise affine, nor `LocalResponseNorm`, which has no gain.
_NORM_TYPE = re.compile(r"(Batch|Layer|Group|Instance|RMS)Norm")


def is_norm_type(module_type: str) -> bool:
    """Whether a module class name is a normalization layer's (see `_NORM_TYPE`)."""
    return _NORM_TYPE.search(module_type) is not None


def module_block(name: str) -> str:
    """The block a module belongs to, for grouping many modules by what repeats.

    Up to the first numbered part when there is one (`encoder.layer.3.attention.self.query`
    → `encoder.layer.3`: the repeated block), else the parent (`embeddings.word_embeddings`
    → `embeddings`); a top-level module (`classifier`) and the root (`""`) are their own block.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def _drop_classes(parts: list[str]) -> list[list[int]]:
    """The dotted parts of a name `shorten_name` may leave out, in the order it does: the
    plain middle parts (root side first), then the first part, then the block indices
    (outermost first). The leaf (the last part) is never among them."""
    middle = [i for i in range(1, len(parts) - 1) if not parts[i].isdigit()]
    first = [0] if len(parts) > 1 and not parts[0].isdigit() else []
    numbers = [i for i in range(len(parts) - 1) if parts[i].isdigit()]
    return [middle, first, numbers]


def _joined(parts: list[str], kept: set[int]) -> str:
    """The kept parts joined by dots, each run of left-out parts one ellipsis."""
    out, gap = "", False
    for i, part in enumerate(parts):
        if i not in kept:
            gap = True
            continue
        if out or gap:
            out += ELLIPSIS if gap else "."
        out, gap = out + part, False
    return out


def shorten_name(name: str, width: int) -> str:
    """A dotted module name in at most `width` characters, shortened from the middle.

    Plain middle parts go first (root side first), then the first part, then the block
    indices; the leaf stays longest: `encoder.layer.11.attention.output.dense` in 33
    characters is `encoder…11.attention.output.dense`, in 16 `encoder…11…dense`, in 9
    `…11…dense`. Only a leaf longer than `width` is itself cut, from its start (`…ense`).
    """
    if len(name) <= width:
        return name
    parts = name.split(".")
    kept = set(range(len(parts)))
    for droppable in _drop_classes(parts):
        while droppable:
            # Of this class's parts whose leaving out makes it fit, the one keeping the most.
            fits = [s for s in (_joined(parts, kept - {i}) for i in droppable) if len(s) <= width]
            if fits:
                return max(fits, key=len)
            kept.discard(droppable.pop(0))
    leaf = parts[-1]
    return (ELLIPSIS + leaf[len(leaf) - width + 1:]) if width > 1 else ELLIPSIS[:width]


def to_jsonable(obj: Any) -> Any:
    """A JSON-ready copy of `obj`.

    Dataclasses become dicts (fields starting with `_` are left out), NaN/Inf become None,
    enums their value, tuples and sets lists, paths strings, and anything else unknown
    `str(obj)`.
    """
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_jsonable(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not f.name.startswith("_")
        }
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def write_json(path: str | Path, payload: Any) -> Path:
    """Write `payload` as indented JSON (after `to_jsonable`), creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_jsonable(payload), indent=2, allow_nan=False) + "\n")
    return out


_PSEUDO_FS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "securityfs",
                        "debugfs", "tracefs", "configfs", "pstore", "bpf", "mqueue",
                        "fusectl", "binfmt_misc", "efivarfs", "autofs"})


def _mount_type(path: Path) -> str | None:
    """The file system type of the mount holding `path` (Linux's mountinfo), or None."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        fields = line.split(" - ", 1)
        head = fields[0].split()
        if len(fields) < 2 or len(head) < 5:
            continue
        point = head[4].encode().decode("unicode_escape")  # spaces come as \040
        inside = point == "/" or str(path) == point or str(path).startswith(point + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[1].split()[0]
    return kind


def _unwritable(folder: Path) -> str | None:
    """Why nothing can be created in the existing folder `folder`; None when it can."""
    kind = _mount_type(Path(os.path.realpath(folder)))
    if kind in _PSEUDO_FS:
        return f"{folder} is on the kernel's {kind} file system, where no file can be created"
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"{folder} is on a read-only file system"
    except (OSError, AttributeError):  # no statvfs (Windows): os.access below still checks
        pass
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable by this user"
    return None


def output_problem(path: str | None, option: str, *, folder: bool = False,
                   suffixes: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """Why an output cannot be written where it points, as (what is wrong, the fix); None
    when it can. Checked before any work, so that a bad path costs nothing.

    It finds a folder where a file is wanted (or the reverse), a file among the parents, a
    file ending the writer does not support, and a nearest existing folder that is not
    writable (permissions, a read-only or pseudo file system such as /proc). Nothing is
    created.

    Args:
        path: the output's path; None (no output asked for) passes.
        option: how the user named it: `--json` (a CLI option) or `out=` (a Python argument).
        folder: the output is a folder to create (`doctor --out`), not a file.
        suffixes: the file endings the writer supports (lower case), e.g. `(".png", ".svg")`.
    """
    if path is None:
        return None
    out = Path(path)
    # `--out /x` on a command line, `out='/x'` for a Python argument.
    where = f"{option}{path!r}" if option.endswith("=") else f"{option} {path}"
    if folder and out.exists() and not out.is_dir():
        return f"{where} is an existing file, not a folder.", "pass a folder path."
    if not folder and out.is_dir():
        return f"{where} is a folder, not a file.", "pass a file path inside it."
    if suffixes and out.suffix.lower() not in suffixes:
        return (f"{option} {path!r} must end in {' or '.join(suffixes)}.",
                f"write e.g. {option} out{suffixes[0]}.")
    absolute = Path(os.path.abspath(out))
    blocking = next((p for p in absolute.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        return (f"{where} lies under {blocking}, which is a file, not a folder.",
                "pass a path whose parent folders are folders.")
    fix = f"pass {option} a path in a folder you can write to."
    if out.exists():
        why = _unwritable(absolute) if folder else (
            None if os.access(absolute, os.W_OK) else f"{path} is not writable by this user")
        return None if why is None else (f"{where} cannot be written: {why}.", fix)
    nearest = next(p for p in absolute.parents if p.exists())
    why = _unwritable(nearest)
    if why is None:
        return None
    first_missing = next(p for p in (absolute, *absolute.parents) if p.parent == nearest)
    if first_missing == absolute and not folder:
        return f"{where} cannot be created: {why}.", fix
    return f"{where} needs the folder {first_missing}, which cannot be created: {why}.", fix
