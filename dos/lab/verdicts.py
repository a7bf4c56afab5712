"""A check's verdict: `CheckTable`, one row per comparison with its `target` and a PASS or MISS
`verdict` (docs/DESIGN.md §5.3). Every check module (checks, state_checks, planner_evidence)
returns one; it prints its verdict above the table."""
from __future__ import annotations

from typing import Sequence

import pandas as pd

PASS, MISS = "PASS", "MISS"


class CheckTable(pd.DataFrame):
    """A check's table: one row per comparison with its `target` and `verdict` (PASS or MISS).
    Its `verdict` is PASS when every row passes (MISS when one misses, or when nothing could be
    compared), and it prints that verdict above the table (text and notebook HTML alike)."""

    @property
    def _constructor(self):
        return CheckTable

    @property
    def graded(self) -> "CheckTable":
        """The rows the verdict is taken over: those with `graded` true where the table has that
        column (the others are reported beside them, e.g. int8 where the criterion grades bf16)."""
        return self[self["graded"].astype(bool)] if "graded" in self.columns else self

    @property
    def verdict(self) -> str:
        g = self.graded
        ok = "verdict" in self.columns and len(g) and g["verdict"].eq(PASS).all()
        return PASS if ok else MISS

    def summary(self) -> str:
        g = self.graded
        if "verdict" not in self.columns or not len(g):
            return f"verdict: {MISS} (no comparable rows)"
        n_pass = int(g["verdict"].eq(PASS).sum())
        targets = "; ".join(dict.fromkeys(str(t) for t in g["target"])) if "target" in g else ""
        extra = f"; {len(self) - len(g)} more reported, not graded" if len(g) < len(self) else ""
        return f"verdict: {self.verdict} ({n_pass} of {len(g)} rows pass{extra}; target: {targets})"

    def __repr__(self) -> str:
        return self.summary() + "\n" + super().__repr__()

    def _repr_html_(self):
        import html

        return f"<p><b>{html.escape(self.summary())}</b></p>" + (super()._repr_html_() or "")


def _check_table(out: list, columns: Sequence[str]) -> CheckTable:
    """`out` (dicts with `target` and `verdict`) as a CheckTable, with `columns` when empty."""
    return CheckTable(out) if out else CheckTable(columns=[*columns, "target", "verdict"])
