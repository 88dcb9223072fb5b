"""Compare two captures: did the fix work, and what did it cost?

Per-rule status (resolved / improved / unchanged / worse / new), headline signals side by side
with 95% bootstrap intervals of the difference, a workload guard that compares like with like,
and one verdict line. See docs/compare.md.
"""
from .api import Comparison, compare, compare_sides
from .sides import Side, SideSpec, load_side, parse_side

__all__ = ["Comparison", "Side", "SideSpec", "compare", "compare_sides", "load_side", "parse_side"]
