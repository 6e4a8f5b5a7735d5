"""The planner: sizes the prefill and decode pools together from a node profile, SLOs and the load (docs/planner.md)."""
