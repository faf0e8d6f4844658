"""One SQLite tier file: the reader on the hit path (kernelfile), its format and
revisions (fileformat), the one writer (filewriter), eviction, alembic migrations,
the schema, the codec, packed attributes (compact), file-system facts (fs), where system files are found
(discovery, entrypoints), and the rows and the Tier protocol every tier shares (rows). Imports only kdb's base modules (errors, logs, config,
keys, ...), never the tiers, the policy, a back end or a front end.
"""
