"""The pure, I/O-free core: no grpc, etcd, otel or socket imports here (a test enforces it)."""
