"""Root test configuration.

Triton decides at kernel-decoration time whether to compile or interpret, so without a
CUDA device the interpreter must be switched on before any kernel module is imported.
Setting it here, before collection, makes the ``*_triton`` kernels runnable on CPU in
every test module regardless of import order.
"""

import os

# OpenMP threads that spin while they wait for work take the cores from every other process: the
# suite runs two workers beside servers and engines of its own, and a tiny model's step then took
# 3.5x as long (tests/engine/test_torture.py's fast run: 19.2 s spinning, 5.6 s passive, under the
# suite's load). libgomp reads this when torch loads it, so it is set before the import; processes
# the tests start inherit it. scripts/test sets it too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Fuzz tests (hypothesis) run the same examples on every run, so a CI result depends on the code
# alone; KVMESH_HYPOTHESIS=explore draws new ones on every run, to hunt for bugs.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("repeatable", derandomize=True, print_blob=True)
_hypothesis_settings.register_profile("explore", derandomize=False)
_hypothesis_settings.load_profile("explore" if os.environ.get("KVMESH_HYPOTHESIS") == "explore" else "repeatable")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_engines_after_each_module():
    """An engine is freed when its last reference goes, but one held from a reference cycle (an
    app's closures, a failed test's traceback) waits for the cycle collector, and an in-process
    server's KV pools are mapped whole at start-up (2 GiB by default on CPU). Collecting after
    each module keeps one process running every suite down to the current module's engines."""
    yield
    gc.collect()


# --- Running the suite on both cores (pytest-xdist; docs/testing.md) ----------------------------------

E2E_GROUP = "e2e"


def group_of(nodeid: str) -> str:
    """The work unit a test runs in: the e2e package is one unit (its tests share one control
    plane, started by a package-scoped fixture), every other module is its own unit (its
    module-scoped servers and engines start once, on the worker that runs the module)."""
    module = nodeid.split("::", 1)[0]
    return E2E_GROUP if module.startswith("tests/e2e/") else module


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """On an xdist worker, order the groups longest-first: the e2e package (it waits on a control
    plane, an image and real pods), then the modules holding slow tests, then the rest in
    collection order. Every worker collects alike, so each computes the same order, and the
    controller hands out groups in that order (ModuleGroupScheduling, without reordering)."""
    if not hasattr(config, "workerinput"):
        return
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(group_of(item.nodeid), []).append(item)

    def rank(entry: tuple[int, tuple[str, list[pytest.Item]]]) -> tuple[int, int]:
        index, (name, members) = entry
        if name == E2E_GROUP:
            return (0, index)
        return (1 if any(m.get_closest_marker("slow") for m in members) else 2, index)

    items[:] = [m for _, (_, members) in sorted(enumerate(groups.items()), key=rank) for m in members]


class _ModuleGroups:
    """Registered only where pytest-xdist is: its scheduler hook is unknown to pytest elsewhere."""

    @pytest.hookimpl(tryfirst=True)  # before xdist's own choice
    def pytest_xdist_make_scheduler(self, config, log):
        from xdist.scheduler import LoadScopeScheduling

        class ModuleGroupScheduling(LoadScopeScheduling):
            """xdist's scope scheduling with group_of's units (a module; the e2e package whole),
            handed out in collection order."""

            def _split_scope(self, nodeid: str) -> str:
                return group_of(nodeid)

        if config.getvalue("dist") != "loadscope":
            return None
        config.option.loadscopereorder = False
        return ModuleGroupScheduling(config, log)


# --- The fast tier's guard -------------------------------------------------------------------------

FAST_TEST_LIMIT_S = 60.0  # a test over this carries the slow (or e2e) marker, with a one-line reason


class _FastTierGuard:
    """Adds up each test's set-up, call and tear-down time (reports from every xdist worker reach
    the controller) and fails the session when a test outside the slow and e2e tiers took longer
    than FAST_TEST_LIMIT_S: the fast tier stays fast because nothing slow can join it unmarked."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if "slow" in report.keywords or "e2e" in report.keywords:
            return
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def over(self) -> list[tuple[str, float]]:
        return sorted(((n, s) for n, s in self.seconds.items() if s > FAST_TEST_LIMIT_S), key=lambda x: -x[1])

    def pytest_terminal_summary(self, terminalreporter) -> None:
        over = self.over()
        if over:
            terminalreporter.section("tests over the fast tier's limit", sep="=", red=True)
            for nodeid, s in over:
                terminalreporter.line(f"{s:7.1f}s {nodeid}: over {FAST_TEST_LIMIT_S:.0f} s without the "
                                      "slow marker (mark it slow with a reason, or make it faster)")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if self.over() and exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_ModuleGroups(), "kvmesh-module-groups")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) sees every report
        config.pluginmanager.register(_FastTierGuard(), "kvmesh-fast-tier-guard")
