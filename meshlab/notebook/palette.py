"""The rank colours: one colour per rank in every widget, chart and table.

Rank r is always ``rank_colour(r)``, so blue means rank 0 in the sharding widget, the
pipeline timeline and the comms chart alike. Text drawn on a colour is black or white,
whichever contrasts more (WCAG 2 contrast ratio; >= 4.5:1 for every colour here).
"""

from __future__ import annotations

# Tableau 10: distinct, and distinguishable by most colour-blind readers in the first 8
RANKS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
         "#ff9da7", "#9c755f", "#bab0ac")


def rank_colour(rank: int) -> str:
    """The colour of ``rank`` everywhere (the palette repeats past 10 ranks)."""
    return RANKS[rank % len(RANKS)]


def _luminance(colour: str) -> float:
    """WCAG 2 relative luminance of ``#rrggbb``."""
    channels = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a: str, b: str) -> float:
    """WCAG 2 contrast ratio of two ``#rrggbb`` colours (1 to 21)."""
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def text_colour(background: str) -> str:
    """Black or white, whichever reads better on ``background``."""
    return "#000000" if contrast(background, "#000000") >= contrast(background, "#ffffff") \
        else "#ffffff"
