"""The fault sweep: every fault kind at every point of the token loop (docs/sweep.md)."""
