"""The PostgreSQL tier a cluster shares: engine and bounds (server), cross-node
locks (locks), the tier (tier), its reports (report), and the keeper that holds
claims of queued stores after their process exits (keeper). Imports the base and
the file wing (schema, codec); never the policy or a back end.
"""
