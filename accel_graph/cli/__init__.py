"""Command-line entry points: ``accel-graph`` (:mod:`accel_graph.cli.main`) and its subcommands."""
