"""Development and test tooling, outside the shipped `extproc` package.

The quickstart stack (`devstack`, `python -m devkit run`), the demo model replica, tool server,
partition proxy and OTLP printer (`demo/`), and dev-only etcd TLS material (`etcd_tls`). The
tests, the benchmarks, the chaos harness and the fault sweep start these as subprocesses; the
image and the wheel never carry them.
"""
