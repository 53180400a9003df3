"""A local Kubernetes control plane from real binaries (no containers).

Used by the `e2e/cluster` executable; see docs/operator.md ("Local control
plane") for what it starts and how the e2e tests use it.
"""
