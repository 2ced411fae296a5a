"""Shared pytest configuration: the accel-graph plugin gives every test a backend/device fixture
(and, on backends that compile, an interpreted and a ``+inductor`` case); ``pytester`` lets the
conformance suite check the plugin itself."""

pytest_plugins = ["accel_graph.testing.plugin", "pytester"]
