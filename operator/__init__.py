"""The kvmesh operator: InferenceDeployment objects -> serving pools.

Pure parts (spec parsing, rendering, status, leader-election decisions, the
CRD itself) are importable without a cluster; app.py and kube.py hold the
kopf handlers and the API calls.
"""
