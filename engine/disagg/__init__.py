"""Prefill/decode disaggregation: the engine-side state of KV handoffs and the UCX link between roles."""
