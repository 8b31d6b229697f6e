"""Envoy ext_proc sidecar for honest LLM streaming failover."""

__version__ = "0.3.0"
