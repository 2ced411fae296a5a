"""The compiled (``+inductor``) case of the upstream port runs the tests marked
``upstream_compiled`` only: every upstream test captures programs of its own, and compiling
each with Inductor costs seconds to tens of seconds on the CPU; the interpreted case runs all."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "upstream_compiled: an upstream-port test that also runs under compile='inductor'"
    )
    config.addinivalue_line(
        "markers", "issue13_item(n, what): the issue-13 feature an upstream-port test exercises"
    )


@pytest.fixture(autouse=True)
def _compiled_subset(request: pytest.FixtureRequest) -> None:
    if "accel_graph_compile" not in request.fixturenames:
        return
    if request.getfixturevalue("accel_graph_compile") is None:
        return
    if request.node.get_closest_marker("upstream_compiled") is None:
        pytest.skip("compiled replay runs the upstream tests marked upstream_compiled "
                    "(one Inductor compilation per captured program costs seconds here)")
