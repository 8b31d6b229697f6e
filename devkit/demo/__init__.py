"""Demo OpenAI-compatible replica with per-request fault hooks."""
