"""Getting entries into the user tier off the caller's critical path: the miss and store side
of ``kdb.tiers.Tiers`` (stores), typed store jobs (jobs), a job's states on disk (jobfiles), whose
spools may run (trust), the spool and the store worker process (spool, worker, lane), claims
kept until their job is stored (holding), the in-process background thread (background).
Imports the base, the file wing and the coordination modules; the worker, a
process of its own, also the policy (KernelDB) and back ends through jobs'
registry.
"""
