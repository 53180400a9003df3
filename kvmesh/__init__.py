"""kvmesh: Kubernetes-native LLM serving with a fleet-wide KV cache."""

__version__ = "0.1.0"
