"""kopf's settings: the child watches carry a server-side label selector that every rendered
child matches, and the InferenceDeployment watch carries none."""

from __future__ import annotations

import kopf

from kvmesh.operator import render as r
from kvmesh.operator.app import CHILD_RESOURCES, build_registry, child_label_selector, configure_settings
from kvmesh.operator.reconcile import Reconciler

from tests.support.crs import make_cr

KIND_TO_RESOURCE = {"Deployment": ("apps", "v1", "deployments"), "Service": ("", "v1", "services"),
                    "ConfigMap": ("", "v1", "configmaps"),
                    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies")}


def matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality and existence terms, the only forms child_label_selector writes."""
    for term in selector.split(","):
        key, eq, value = term.partition("=")
        if key not in labels or (eq and labels[key] != value):
            return False
    return True


def test_child_watches_are_filtered_by_the_api_server():
    settings = kopf.OperatorSettings()
    configure_settings(settings)
    # What kopf puts into the labelSelector parameter of its list and watch requests.
    for group, version, plural in CHILD_RESOURCES:
        assert settings.watching.label_selectors.collect(kopf.Resource(group, version, plural)) == [
            child_label_selector()], plural
    assert child_label_selector() == (f"app.kubernetes.io/managed-by={r.MANAGED_BY},{r.OWNER_LABEL}")
    crd = kopf.Resource("serving.kvmesh.io", "v1alpha1", "inferencedeployments")
    assert settings.watching.label_selectors.collect(crd) == []
    # Not every Deployment in the cluster: others' Deployments, Pods, Secrets get no selector
    # because the operator does not watch them at all.
    assert settings.watching.label_selectors.collect(kopf.Resource("", "v1", "secrets")) == []
    assert settings.scanning.disabled


def test_every_rendered_child_passes_the_selector():
    objs = r.render_all(make_cr())
    assert {o["kind"] for o in objs} == set(KIND_TO_RESOURCE)
    for o in objs:
        assert matches(child_label_selector(), o["metadata"]["labels"]), o["metadata"]["name"]
    assert not matches(child_label_selector(), {"app.kubernetes.io/managed-by": "Helm"})


def test_registry_watches_the_crd_and_the_three_child_kinds():
    registry = build_registry(Reconciler.__new__(Reconciler))
    watched = {(res.group, res.version, res.plural)
               for res in [kopf.Resource(*t) for t in CHILD_RESOURCES]
               + [kopf.Resource("serving.kvmesh.io", "v1alpha1", "inferencedeployments")]
               if registry._watching.has_handlers(res)}
    assert watched == set(CHILD_RESOURCES) | {("serving.kvmesh.io", "v1alpha1", "inferencedeployments")}
