"""The graph API: :class:`~.graph.Graph` and the ``graph`` context manager, lifecycle hooks,
``check_capturable``, ``make_graphed_callables``, device queries and the documented differences
from torch's graph API. Public names are re-exported lazily by the :mod:`accel_graph` face; this
package routes every call to a backend (:mod:`accel_graph.backends`)."""
