"""What zerojax shows: terminal tables, the self-contained HTML page, its charts.

    tables.py   rich tables for memory, analyze and formats
    plan_tables.py  `zerojax plan`'s ranked candidates and its winner
    runs.py     a run directory as the page reads it
    page.py     the HTML page (template, CSS and script in zerojax/page/)
    plots.py    matplotlib charts as inline SVG

The package names what the CLI calls (`read_run`, `write_page`, `emit` and its tables); it imports
no jax, nor matplotlib (`plots` is imported when a page is drawn).
"""

from zerojax.report.page import write_page
from zerojax.report.plan_tables import plan_tables
from zerojax.report.runs import ANALYSIS, Run, analyze_run, read_run
from zerojax.report.tables import analyze_table, emit, formats_tables, memory_table

__all__ = ["ANALYSIS", "Run", "analyze_run", "analyze_table", "emit", "formats_tables", "memory_table", "plan_tables",
           "read_run", "write_page"]
