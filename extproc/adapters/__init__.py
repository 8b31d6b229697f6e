"""Thin adapters around the core: Envoy codec, gRPC server, etcd store."""
