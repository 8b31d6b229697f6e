"""The fault sweep as a program (`python -m devkit.sweep`, `make sweep`): every fault kind at
every point of the token loop, checked per request_id (docs/sweep.md). tests/sweep runs its
fixed-seed slices under pytest."""
