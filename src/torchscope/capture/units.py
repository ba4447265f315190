"""Which dimension of an activation holds its units: dim 1 or the last one.

A convolution lays its output out as (N, C, *spatial), so a dead ReLU unit there is a
channel of dim 1. A linear layer on a sequence gives (N, T, C): its units are the last
dimension, and dim 1 holds the positions. Counting dead units over dim 1 there asks
whether a token position is zero in every unit, which is never the question (a T5 feed-
forward with 48 of its 64 units dead read as none dead).

The output's shape alone cannot tell the two apart: a (4, 16, 64) tensor may be either.
The layers around the activation can. `unit_candidates` reads, once per hooked module,
the sizes and layouts of the nearest weighted layers beside it in its parent (nearest
first: a `nn.Sequential` lists its layers in the order they run; a parent with none
defers to the one above), and `unit_dim` takes, at each call, the first whose size sits
where its layout puts it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.conv import _ConvNd

__all__ = ["Candidate", "unit_candidates", "unit_dim"]

Candidate = tuple[int, bool]
"""(units, first): a layer's output units and whether it puts them in dim 1 (else last)."""


def _layer_units(m: nn.Module) -> list[Candidate]:
    if isinstance(m, _ConvNd):
        return [(m.out_channels, True)]
    if isinstance(m, _NormBase):  # BatchNorm and InstanceNorm: (N, C, ...)
        return [(m.num_features, True)]
    if isinstance(m, nn.GroupNorm):
        return [(m.num_channels, True)]
    if isinstance(m, nn.Linear | nn.Bilinear):
        return [(m.out_features, False)]
    if isinstance(m, nn.LayerNorm) and m.normalized_shape:
        return [(m.normalized_shape[-1], False)]
    if isinstance(m, nn.Embedding):
        return [(m.embedding_dim, False)]
    # A library's own linear layer (transformers' Conv1D keeps its weight as (in, out), a
    # LoRA wrapper hands out its base layer's) or norm: units last, either size of a 2-D
    # weight, or a 1-D weight's.
    try:
        w = getattr(m, "weight", None)
    except Exception:  # a property that cannot answer for a bare module
        return []
    shape = getattr(w, "shape", None)
    if shape is None or not 1 <= len(shape) <= 2:
        return []
    return [(int(n), False) for n in dict.fromkeys(reversed(tuple(shape)))]


# Weighted layers looked at on each side of an activation: the nearest fits in every model
# tried, and a long `nn.Sequential` would otherwise give each of its activations all of its
# layers (a thousand-layer one took 2.6 s to open).
_NEAREST = 4

_Children = tuple[dict[str, int], list[list[Candidate]], list[list[Candidate]]]
"""A parent's children: each one's index, and each one's units as seen from after it
(nearest last) and from before it (nearest first)."""


def unit_candidates(model: nn.Module, name: str,
                    cache: dict[str, _Children] | None = None) -> tuple[Candidate, ...]:
    """The units of the weighted layers beside module `name`, nearest first: in its parent,
    up to `_NEAREST` registered before it (the nearer the earlier), then up to `_NEAREST`
    after it; a container beside it (an `nn.ModuleList` of layers, a block) gives its own
    children's. Where its parent holds none, the same one level up, and so on to the root.

    Args:
        model: the root module.
        name: a qualified module name; the root has no siblings and gets none.
        cache: kept between calls on one model, so that each parent's children are read
            once.
    """
    cache = {} if cache is None else cache
    while name:
        parent_name, _, own = name.rpartition(".")
        kids = cache.get(parent_name)
        if kids is None:
            try:
                parent = model.get_submodule(parent_name)
            except AttributeError:
                return ()
            children = list(parent.named_children())
            kids = cache[parent_name] = (
                {n: i for i, (n, _) in enumerate(children)},
                [_beside(m, nearest_last=True) for _, m in children],
                [_beside(m, nearest_last=False) for _, m in children])
        index, before, after = kids
        at = index.get(own)
        if at is None:
            return ()
        found: list[Candidate] = []
        for i in range(at - 1, -1, -1):
            if len(found) >= _NEAREST:
                break
            found += before[i]
        ahead: list[Candidate] = []
        for i in range(at + 1, len(after)):
            if len(ahead) >= _NEAREST:
                break
            ahead += after[i]
        if found or ahead:
            return tuple(found + ahead)
        name = parent_name
    return ()


def _beside(m: nn.Module, *, nearest_last: bool) -> list[Candidate]:
    """A sibling's units: its own, else its children's (one level down), nearest first."""
    own = _layer_units(m)
    if own:
        return own
    kids = list(m.children())
    return [c for k in (kids[::-1] if nearest_last else kids) for c in _layer_units(k)]


def unit_dim(shape: Sequence[int], candidates: Sequence[Candidate]) -> int:
    """The dimension of an output of `shape` that holds its units: the first candidate's
    whose size sits in dim 1 (a layout with units first) or in the last dim (units last);
    dim 1 when none fits (and always for a tensor of 2 dims, where the two are one).

    Args:
        shape: the output's shape, of 2 or more dims.
        candidates: from `unit_candidates`.
    """
    last = len(shape) - 1
    if last > 1:
        for units, first in candidates:
            if first and shape[1] == units:
                return 1
            if not first and shape[last] == units:
                return last
    return 1
