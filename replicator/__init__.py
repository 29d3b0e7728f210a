"""Replication of mountfs snapshots to mirrors: changesets from the epoch-pruned diff
(changeset), the mirror side (mirror), reaching a mirror by URL (endpoints), the Spark job
that moves chunks (transfer) and one cycle end to end (cycle)."""
