"""Grammar-constrained decoding: structured outputs (docs/server.md, "Structured outputs")."""
