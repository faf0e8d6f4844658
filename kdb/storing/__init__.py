"""Getting entries into the user tier off the caller's critical path: the miss and store side
of ``kdb.tiers.Tiers`` (stores), typed store jobs (jobs), a job's states on disk (jobfiles), whose
spools may run (trust), the spool a process writes its jobs to and the worker it starts
(spool), claims kept until their job is stored (holding), a store queued by a process that
exited, waited for by the next that misses it (queued), what stores cost (storetimes), the
in-process background thread (background). Imports the base, the file wing and the
coordination modules only; the processes that store the jobs are :mod:`kdb.worker`.
"""
