"""Helpers every process uses: Prometheus metric helpers and command-line argument types."""
