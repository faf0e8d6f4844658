"""Zero-code adoption: KDB_AUTO's adoption functions (auto), `kdb run` (run), the
per-process counts they add up (tally) and the pytest plugin (pytest). A front end:
imports the layers below it; ``auto`` imports the back ends it adopts for.
"""
