"""Reading MLIR text by its regions: the depth of every line, and the definition of a value
visible from a line.

MLIR reuses value names in sibling regions (two branches, the two regions of a
``scf.while``), so a name means the definition in a region that encloses the use; the
rewrites and checks of the Ascend lowering resolve names this way.
"""

from __future__ import annotations

import re

__all__ = ["strip", "Lines"]


def strip(line: str) -> str:
    """The line without its location and without balanced ``{...}`` attribute groups (what
    remains of braces opens or closes regions)."""
    line = re.sub(r"\bloc\((?:[^()]|\([^()]*\))*\)", "", line)
    while True:
        shorter = re.sub(r"\{[^{}]*\}", "", line)
        if shorter == line:
            return line
        line = shorter


class Lines:
    """The lines of an MLIR text with the region depth each one is in."""

    def __init__(self, text: str):
        self.lines = text.splitlines()
        self.depth: list[int] = []
        self.opens: list[bool] = []  # the line opens a region
        self.closes: list[int] = []  # regions the line closes before its own content
        depth = 0
        for line in self.lines:
            body = strip(line).strip()
            closes = re.match(r"[})\s]*", body).group(0).count("}")
            depth = max(0, depth - closes)
            self.depth.append(depth)
            self.closes.append(closes)
            opens = body.endswith("{")
            self.opens.append(opens)
            depth += opens

    def definition(self, index: int, name: str, pattern: str) -> re.Match | None:
        """The nearest definition of ``name`` visible at line ``index`` that matches
        ``pattern`` (a regular expression with ``{name}`` where the name goes)."""
        regex = re.compile(pattern.format(name=re.escape(name)))
        floor = self.depth[index]
        for i in range(index - 1, -1, -1):
            floor = min(floor, self.depth[i])
            if self.depth[i] == floor:
                found = regex.search(self.lines[i])
                if found:
                    return found
        return None
