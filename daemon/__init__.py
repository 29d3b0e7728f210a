"""mountfsd: continuous snapshots, replication to every configured mirror, retention and
status, for filesystems mounted with mountfs (see service.py for the loop)."""
