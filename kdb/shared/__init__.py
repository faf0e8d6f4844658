"""The PostgreSQL tier a cluster shares: engine and bounds (server), cross-node
locks (locks), the tier (tier), its cap and batched hits (usage), its reports
(report), the keeper that holds claims of queued stores after their process exits
(keeper), and the SQL that sets a tenant up (tenants). Imports the base, the file
wing (schema, codec), the claims wing (its cross-node locks are claims that span nodes)
and, for a trust policy, the signing wing; never the policy or a back end.
"""
