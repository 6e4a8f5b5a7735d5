"""Cluster operations: Ray-placed pools, the tandem CLI, the admin API."""
