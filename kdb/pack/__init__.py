"""Building system databases and their wheels: manifests, inputs (a user file, the
start-up log), compiling for a pack, the system file, the wheel. A front end: imports
the layers below it; only ``compiling`` imports a back end.
"""
