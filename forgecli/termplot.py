"""A line plot in the terminal, drawn with braille characters (2×4 dots a cell) and rendered by Rich.

Small on purpose: `forge runs compare` needs a few curves on shared axes, with a legend, in colour on a
terminal and plain off it — which Rich already decides (NO_COLOR, pipes). A plotting package for this
would be one more dependency whose API has changed across major versions.
"""

from __future__ import annotations

from rich.text import Text

BRAILLE = 0x2800
DOTS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))  # [row][column] of a cell's 4×2 dots
COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")

Series = tuple[str, list[float], list[float]]  # label, x, y


def line_plot(series: list[Series], width: int = 72, height: int = 16, title: str = "", x_label: str = "") -> Text:
    """`series` on shared axes; each in its own colour, its points joined by straight lines."""
    points = [(x, y) for _, xs, ys in series for x, y in zip(xs, ys)]
    if not points:
        return Text(f"{title}: nothing logged yet")
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    cols, rows = width * 2, height * 4
    # (row, col) of a cell → its dots (a negative -n: curve n's number) and the colour of the last curve drawn there
    cells: dict[tuple[int, int], tuple[int, str]] = {}

    def dot_of(x: float, y: float) -> tuple[int, int]:
        return (
            rows - 1 - round((y - y0) / ((y1 - y0) or 1) * (rows - 1)),
            round((x - x0) / ((x1 - x0) or 1) * (cols - 1)),
        )

    def cell_of(x: float, y: float) -> tuple[int, int]:
        r, c = dot_of(x, y)
        return r // 4, c // 2

    def dot(x: float, y: float, colour: str) -> None:
        r, c = dot_of(x, y)
        bits, _ = cells.get((r // 4, c // 2), (0, colour))
        cells[r // 4, c // 2] = (max(bits, 0) | DOTS[r % 4][c % 2], colour)

    for i, (_, xs, ys) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        for (xa, ya), (xb, yb) in zip(zip(xs, ys), list(zip(xs, ys))[1:]):
            n = max(2, int(2 * (abs(xb - xa) / ((x1 - x0) or 1) * cols + abs(yb - ya) / ((y1 - y0) or 1) * rows)))
            for k in range(n + 1):
                dot(xa + (xb - xa) * k / n, ya + (yb - ya) * k / n, colour)
        for x, y in zip(xs, ys):
            dot(x, y, colour)
    for i, (_, xs, ys) in enumerate(series):  # each curve's number at its end: the legend without colour too
        if xs:
            cell = cell_of(xs[-1], ys[-1])
            cells[cell] = (-(i + 1), COLOURS[i % len(COLOURS)])
    return render(cells, series, width, height, (x0, x1, y0, y1), title, x_label)


def render(
    cells: dict[tuple[int, int], tuple[int, str]],
    series: list[Series],
    width: int,
    height: int,
    bounds: tuple[float, float, float, float],
    title: str,
    x_label: str,
) -> Text:
    """The canvas with a y axis (top, middle, bottom values), an x axis (first and last), and a legend."""
    x0, x1, y0, y1 = bounds
    labels = {0: f"{y1:.4g}", height // 2: f"{(y0 + y1) / 2:.4g}", height - 1: f"{y0:.4g}"}
    margin = max(len(label) for label in labels.values()) + 1
    out = Text(f"{title}\n" if title else "", style="bold")
    for row in range(height):
        out.append(labels.get(row, "").rjust(margin) + "│")
        for col in range(width):
            bits, colour = cells.get((row, col), (0, ""))
            out.append(str(-bits % 10) if bits < 0 else chr(BRAILLE + bits) if bits else " ", style=colour)
        out.append("\n")
    left, right = f"{x0:.4g}", f"{x1:.4g}"
    out.append(" " * margin + "└" + "─" * width + "\n")
    out.append(" " * (margin + 1) + left + x_label.center(width - len(left) - len(right)) + right + "\n")
    for i, (label, _, _) in enumerate(series):
        out.append(" " * (margin + 1)).append(f"{(i + 1) % 10} ━━ ", style=COLOURS[i % len(COLOURS)]).append(
            label + "\n"
        )
    return out
