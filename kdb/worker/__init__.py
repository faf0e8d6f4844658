"""The store worker: the processes that store the jobs a spool holds, off every caller's
critical path. The supervisor of one spool (supervisor), its lanes, each a child that meets
``KernelDB`` and a job's back end (lane), and the store-ahead of a process that waits for
jobs an earlier process queued (ahead). Started as ``python -m kdb.worker`` (``__main__``);
imports the storing wing, the policy (KernelDB) and back ends through the jobs' registry.
Nothing here is imported by a process that only looks kernels up.
"""
