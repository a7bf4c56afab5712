"""PURE: parameters -> flat buckets -> equal-size subgroups.

A *bucket* holds the trainable parameters of one param group and one dtype, packed one after
another into a flat buffer (each parameter starts on an `ALIGN`-element boundary so that the
model's kernels see aligned pointers). A bucket is cut into *subgroups* of `subgroup_numel`
elements; only the last subgroup of a bucket is shorter. A parameter may span two subgroups.
Everything here works on numbers only; the engine maps the result onto tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

ALIGN = 64  # elements; 128 B for bf16, 256 B for fp32

# Subgroup size rule: ~32 subgroups for small models, at most MAX_AUTO elements each (the
# minimal H200 pipeline in DESIGN.md §8 ran 50M-element subgroups), at least MIN_AUTO.
MAX_AUTO = 50_331_648  # 48 Mi elements
MIN_AUTO = 4_096
TARGET_SUBGROUPS = 32


@dataclass(frozen=True)
class ParamSlot:
    """Where one trainable parameter lives: its bucket and element range in the bucket."""

    group: int
    index: int  # position among the group's trainable parameters
    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """Flat storage of one (param group, dtype): `numel` elements incl. alignment padding."""

    index: int
    group: int
    dtype: str
    numel: int
    slots: Tuple[ParamSlot, ...]


@dataclass(frozen=True)
class Subgroup:
    """The unit of placement and movement: elements [start, start + numel) of a bucket."""

    index: int
    bucket: int
    start: int
    numel: int

    @property
    def stop(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Layout:
    buckets: Tuple[Bucket, ...]
    subgroups: Tuple[Subgroup, ...]
    subgroup_numel: int

    @property
    def numel(self) -> int:
        """Elements in all buckets, padding included."""
        return sum(b.numel for b in self.buckets)

    @property
    def n_params(self) -> int:
        """Elements of the trainable parameters (no padding)."""
        return sum(s.numel for b in self.buckets for s in b.slots)

    def slots(self) -> List[ParamSlot]:
        return [s for b in self.buckets for s in b.slots]


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def choose_subgroup_numel(total: int) -> int:
    """Default subgroup size for `total` elements: ~TARGET_SUBGROUPS subgroups, clamped."""
    n = align_up(max(1, math.ceil(total / TARGET_SUBGROUPS)))
    return max(MIN_AUTO, min(MAX_AUTO, n))


def partition(groups: Sequence[Sequence[Tuple[int, str]]], subgroup_numel: int | None = None) -> Layout:
    """Lay out parameters given as, per param group, a list of (numel, dtype name).

    Buckets are ordered by group, then by first appearance of the dtype in the group; parameters
    keep their order inside a bucket. Zero-element parameters get a slot of size 0.
    """
    bucket_specs = []  # (group, dtype, [(index, numel)])
    for g, params in enumerate(groups):
        by_dtype: dict = {}
        for i, (numel, dtype) in enumerate(params):
            if numel < 0:
                raise ValueError(f"negative numel {numel}")
            by_dtype.setdefault(dtype, []).append((i, numel))
        bucket_specs.extend((g, dt, items) for dt, items in by_dtype.items())

    buckets = []
    for b, (g, dt, items) in enumerate(bucket_specs):
        offset, slots = 0, []
        for i, numel in items:
            slots.append(ParamSlot(group=g, index=i, bucket=b, offset=offset, numel=numel))
            offset = align_up(offset + numel)
        buckets.append(Bucket(index=b, group=g, dtype=dt, numel=offset, slots=tuple(slots)))

    total = sum(b.numel for b in buckets)
    if subgroup_numel is None:
        subgroup_numel = choose_subgroup_numel(total)
    if subgroup_numel < 1:
        raise ValueError(f"subgroup_numel must be >= 1, got {subgroup_numel}")

    subgroups = []
    for b in buckets:
        for start in range(0, b.numel, subgroup_numel):
            subgroups.append(Subgroup(index=len(subgroups), bucket=b.index, start=start,
                                      numel=min(subgroup_numel, b.numel - start)))
    return Layout(buckets=tuple(buckets), subgroups=tuple(subgroups), subgroup_numel=subgroup_numel)


def subgroups_of(layout: Layout, slot: ParamSlot) -> List[int]:
    """Indices of the subgroups a parameter's elements fall into (none for an empty one)."""
    if slot.numel == 0:
        return []
    first = next(s.index for s in layout.subgroups if s.bucket == slot.bucket)
    lo = slot.offset // layout.subgroup_numel
    hi = (slot.offset + slot.numel - 1) // layout.subgroup_numel
    return list(range(first + lo, first + hi + 1))
