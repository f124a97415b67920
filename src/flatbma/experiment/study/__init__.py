"""``flatbma compare``: methods × seeds × candidates planned, trained, selected, width-matched, measured, cached."""
