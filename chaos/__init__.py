"""The project's own chaos harness (dev tooling, not part of the shipped `extproc` package).

`python -m chaos --duration S --seed N` runs mixed client traffic through a loopback
devstack (real Envoy, real etcd, the processor, demo replicas) while a seeded chaos loop
kills, freezes and restarts replicas, the processor and etcd members; then it checks every
request against the client contract and the journal (chaos/checks.py) and writes a report.
docs/chaos.md explains the faults, the break kinds and the report.
"""
