"""Shared pytest configuration: the accel-graph plugin gives every test a backend/device fixture."""

pytest_plugins = ["accel_graph.testing.plugin"]
