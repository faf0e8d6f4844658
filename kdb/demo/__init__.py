"""`kdb demo`: the two runs and their table (runs) and the programs it builds
(programs, kernels/). A front end: imports
the layers below it; ``programs`` imports the OpenCL back end.
"""
