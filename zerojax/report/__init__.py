"""What zerojax shows: terminal tables, the self-contained HTML page, its charts.

    tables.py   rich tables for memory, analyze and formats
    plan_tables.py  `zerojax plan`'s ranked candidates and its winner
    runs.py     a run directory as the page reads it
    page.py     the HTML page (template, CSS and script in zerojax/page/)
    plots.py    matplotlib charts as inline SVG
"""

from zerojax.report.page import *  # noqa: F401,F403
from zerojax.report.plan_tables import *  # noqa: F401,F403
from zerojax.report.runs import *  # noqa: F401,F403
from zerojax.report.tables import *  # noqa: F401,F403
