"""Render rich tables as GitHub markdown, for pasting a run's tables into a page."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text


def table_to_markdown(table: Table) -> str:
    def plain(x: object) -> str:
        return Text.from_markup(x).plain if isinstance(x, str) else str(x)

    headers = [plain(c.header) for c in table.columns]
    cols = [[plain(v) for v in c._cells] for c in table.columns]
    rows = list(zip(*cols, strict=True)) if cols else []
    align = ["---:" if c.justify == "right" else "---" for c in table.columns]
    lines = []
    if table.title:
        lines += [f"**{plain(table.title)}**", ""]
    lines += ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


class Out:
    """Prints rich tables to the terminal, or as markdown with ``--markdown`` (for pasting into a page)."""

    def __init__(self, markdown: bool = False) -> None:
        from rich.console import Console

        self.markdown = markdown
        self.console = Console(width=200)

    def print(self, obj: object) -> None:
        if not self.markdown:
            self.console.print(obj)
        elif isinstance(obj, Table):
            print(table_to_markdown(obj))
        else:
            print(Text.from_markup(obj).plain if isinstance(obj, str) else obj, end="\n\n")
