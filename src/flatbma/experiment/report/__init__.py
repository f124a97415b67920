"""The report of a comparison's results: their rows, findings, tables, figures, and the CSV/Markdown/HTML documents."""
