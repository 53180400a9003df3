"""The running operator: kopf watches, thin handlers, leader election, resync.

Handlers only translate a watch event into "reconcile this CR" (reconcile.py
does the work); no handler keeps state in the watched objects, so the operator
adds no finalizers and no kopf annotations, and deleting an
InferenceDeployment never waits on the operator: the garbage collector
removes the children.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field

import kopf

from . import kube
from . import spec as s
from .health import HealthState, serve_health
from .leader import LeaseElector, LeaseStore
from . import engine_admin
from .autoscale_loop import AutoscaleIO, AutoscaleRunner
from .metrics import OperatorMetrics
from .metrics_source import PodScrapeSource, PrometheusSource
from .reconcile import KubeOps, Reconciler, ReconcileError
from .render import ENGINE_PORT, MANAGED_BY, OWNER_LABEL
from .scaling import DELETION_COST, DRAIN_ANNOTATION, LOWEST_COST, PodInfo

log = logging.getLogger("kvmesh.operator")


@dataclass
class OperatorOptions:
    namespaces: list[str] = field(default_factory=list)  # empty: all namespaces
    leader_election: bool = True
    lease_name: str = "kvmesh-operator"
    lease_namespace: str | None = None
    lease_duration_s: int = 15
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    identity: str | None = None
    health_host: str = "0.0.0.0"
    health_port: int | None = 8080
    resync_s: float = 60.0
    prometheus_url: str | None = None  # None: the autoscaler scrapes the pods itself
    autoscale_s: float = 15.0
    # How long a drained engine waits for this operator (or its next leader) before it serves
    # again; renewed on every autoscaler tick, so several ticks and a leader change fit in it.
    drain_lease_s: float = 120.0


def production_ops() -> KubeOps:
    return KubeOps(
        get=kube.get_inference_deployment,
        apply=kube.apply,
        deployments=kube.child_deployments,
        patch_status=kube.patch_status,
        create_if_absent=kube.create_if_absent,
        apply_error=kube.ApplyError,
        pods=kube.owner_pods,
        delete_owned=kube.delete_owned,
    )


def production_autoscaler(reconciler: Reconciler, opts: OperatorOptions,
                          metrics: OperatorMetrics | None = None) -> AutoscaleRunner:
    source = PrometheusSource(opts.prometheus_url) if opts.prometheus_url else PodScrapeSource()

    def pods(ns: str, name: str, pool: str) -> list[PodInfo]:
        found = kube.ready_pool_pods(ns, name, pool, ENGINE_PORT)
        token = kube.auth_token(ns, name) if found else None  # /admin/drain needs it
        return [PodInfo(p["name"], p["endpoint"], engine_admin.in_flight(p["endpoint"], token), token)
                for p in found]

    def recorded_drains(ns: str, name: str, pool: str) -> list[tuple[PodInfo, str]]:
        found = [p for p in kube.pool_pods(ns, name, pool, ENGINE_PORT) if DRAIN_ANNOTATION in p["annotations"]]
        token = kube.auth_token(ns, name) if found else None
        return [(PodInfo(p["name"], p["endpoint"], None, token), p["annotations"][DRAIN_ANNOTATION]) for p in found]

    def router_readiness(ns: str, name: str) -> list[tuple[str, dict | None]]:
        return [(p["name"], engine_admin.ready_report(p["endpoint"]))
                for p in kube.pool_pods(ns, name, "router", ENGINE_PORT)]

    def apply_replicas(ns: str, name: str) -> None:
        _run(reconciler, ns, name)

    return AutoscaleRunner(source, AutoscaleIO(
        ready_pods=pods,
        start_drain=lambda pod: engine_admin.start_drain(pod.endpoint, opts.drain_lease_s, pod.token),
        cancel_drain=lambda pod: engine_admin.cancel_drain(pod.endpoint, pod.token),
        in_flight=lambda pod: engine_admin.in_flight(pod.endpoint, pod.token),
        is_draining=lambda pod: engine_admin.is_draining(pod.endpoint, pod.token),
        record_drain=lambda ns, pod, record: kube.annotate_pod(ns, pod.name, {DRAIN_ANNOTATION: record}),
        recorded_drains=recorded_drains,
        mark_for_deletion=lambda ns, pod: kube.annotate_pod(ns, pod.name,
                                                            {DELETION_COST: str(LOWEST_COST)}),
        patch_status=kube.patch_status,
        apply_replicas=apply_replicas,
        event=kube.emit_event,
        router_readiness=router_readiness,
        router_endpoints=lambda ns, name: tuple(
            p["endpoint"] for p in kube.ready_pool_pods(ns, name, "router", ENGINE_PORT)),
    ), metrics=metrics)


async def _autoscale_forever(runner: AutoscaleRunner, opts: OperatorOptions) -> None:
    """One autoscaler tick per CR every autoscale_s seconds (also reports SLOMet when off)."""
    while True:
        await asyncio.sleep(opts.autoscale_s)
        try:
            objects = []
            for ns in opts.namespaces or [None]:
                objects += await asyncio.to_thread(kube.list_inference_deployments, ns)
        except Exception as exc:
            log.warning("autoscaler: listing failed: %s", exc)
            continue
        runner.retain([(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objects])
        for obj in objects:
            try:
                await asyncio.to_thread(runner.tick, obj, time.time())
            except Exception as exc:  # one CR's failure must not stop the others
                meta = obj.get("metadata", {})
                log.warning("autoscaler: %s/%s: %s", meta.get("namespace"), meta.get("name"), exc)


def _run(reconciler: Reconciler, namespace: str | None, name: str | None) -> None:
    if not namespace or not name:
        return
    try:
        reconciler.request(namespace, name)
    except ReconcileError as exc:
        # Reported in the CR's Degraded condition too; retried on the next event/resync.
        log.warning("%s", exc)


# The children the operator watches (group, version, plural), and the labels every one carries.
CHILD_RESOURCES: tuple[tuple[str, str, str], ...] = (
    ("apps", "v1", "deployments"), ("", "v1", "services"), ("", "v1", "configmaps"),
    ("networking.k8s.io", "v1", "networkpolicies"))
CHILD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY, OWNER_LABEL: kopf.PRESENT}


def child_label_selector() -> str:
    """CHILD_LABELS as a Kubernetes label selector ("key=value" or "key" for presence)."""
    return ",".join(k if v is kopf.PRESENT else f"{k}={v}" for k, v in CHILD_LABELS.items())


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """kopf's settings for this operator (invariant: child watches are filtered server-side).

    A handler's `labels=` filter runs in the operator, after the API server has
    streamed every Deployment, Service and ConfigMap of the watched namespaces;
    kopf's `settings.watching.label_selectors` instead puts a labelSelector on
    the list and watch requests of the matching resources, so only the
    operator's own children cross the wire. The handlers keep `labels=` too: it
    is what kopf matches handlers on, and it costs nothing once the stream is
    filtered. The InferenceDeployment watch gets no selector (every one counts).
    """
    settings.posting.level = logging.WARNING
    # Serve the resources that exist at startup; watching CRDs and
    # namespaces for changes would need cluster-wide RBAC the operator
    # otherwise has no use for. (The chart installs the CRD first.)
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    for group, version, plural in CHILD_RESOURCES:
        key = (group, version, plural) if group else (version, plural)
        settings.watching.label_selectors[key] = child_label_selector()


def build_registry(reconciler: Reconciler) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: object) -> kopf.ConnectionInfo | None:
        # Same discovery as kube.py: $KUBECONFIG / ~/.kube/config or in-cluster.
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(id="configure", registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: object) -> None:
        configure_settings(settings)

    @kopf.on.event(s.GROUP, s.VERSION, s.PLURAL, id="inference-deployment", registry=registry)
    def on_inference_deployment(event: dict, namespace: str, name: str, **_: object) -> None:
        if event.get("type") == "DELETED":
            return
        _run(reconciler, namespace, name)

    def on_child(labels: dict, namespace: str, **_: object) -> None:
        # Any change to a child, including its deletion, re-renders its owner:
        # a hand edit is reverted and a deleted child re-created.
        _run(reconciler, namespace, labels.get(OWNER_LABEL))

    for group, version, plural in CHILD_RESOURCES:
        resource = (group, version, plural) if group else (version, plural)
        kopf.on.event(*resource, id=f"child-{plural}", labels=CHILD_LABELS,
                      registry=registry)(on_child)
    return registry


async def _resync_forever(reconciler: Reconciler, opts: OperatorOptions) -> None:
    """Backstop for missed events: reconcile every CR every resync_s seconds."""
    while True:
        await asyncio.sleep(opts.resync_s)
        try:
            objects = []
            for ns in opts.namespaces or [None]:
                objects += await asyncio.to_thread(kube.list_inference_deployments, ns)
            await asyncio.to_thread(reconciler.resync, objects)
        except Exception as exc:
            log.warning("resync failed: %s", exc)


def _default_identity() -> str:
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def _lease_namespace(opts: OperatorOptions) -> str:
    if opts.lease_namespace:
        return opts.lease_namespace
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    if os.path.exists(path):
        with open(path) as fh:
            return fh.read().strip()
    return "default"


async def run_operator(opts: OperatorOptions) -> int:
    """Run until stopped (0) or until leadership is lost (1)."""
    identity = opts.identity or _default_identity()
    elector = None
    if opts.leader_election:
        store = LeaseStore(_lease_namespace(opts), opts.lease_name)
        elector = LeaseElector(store, identity, opts.lease_duration_s,
                               opts.renew_deadline_s, opts.retry_period_s)
    metrics = OperatorMetrics()
    health = HealthState(identity, is_leader=lambda: elector is None or elector.is_leader,
                         metrics=metrics.exposition)
    server = None
    if opts.health_port is not None:
        server = await serve_health(health, opts.health_host, opts.health_port)
    health.started = True
    await asyncio.to_thread(kube.api_client)  # fail fast on a bad kubeconfig
    try:
        if elector is not None:
            await elector.acquire()
        reconciler = Reconciler(production_ops())
        stop = asyncio.Event()
        kopf_task = asyncio.create_task(kopf.operator(
            registry=build_registry(reconciler),
            standalone=True,  # exclusivity comes from the Lease, not kopf peering
            clusterwide=not opts.namespaces,
            namespaces=opts.namespaces,
            stop_flag=stop,
        ))
        others = [asyncio.create_task(_resync_forever(reconciler, opts)),
                  asyncio.create_task(_autoscale_forever(
                      production_autoscaler(reconciler, opts, metrics), opts))]
        hold = asyncio.create_task(elector.hold()) if elector is not None else None
        waiting = {kopf_task} | ({hold} if hold else set())
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        lost = hold is not None and hold in done
        stop.set()
        for task in others + ([hold] if hold and not hold.done() else []):
            task.cancel()
        await asyncio.gather(kopf_task, *others, return_exceptions=True)
        return 1 if lost else 0
    finally:
        if elector is not None:
            await asyncio.to_thread(elector.release)
        if server is not None:
            server.close()
