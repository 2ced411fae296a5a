"""The allocator engine: the C core (built by cffi at install time) and its Python face.

- ``engine``: :class:`Engine`, one device's caching allocator; ``settings``: the
  :class:`EngineSettings` it is built from and the C rounding rules; ``status``: C status codes
  to exceptions; ``tensor_blocks``: tensors that own engine blocks.
- ``stats``: PyTorch-named statistics, snapshots and the OOM message.
- ``device_plugin`` (with ``device_settings``): our engine behind torch's
  ``CUDAPluggableAllocator`` (not the pytest plug-in, which is ``accel_graph.testing.plugin``).
- ``loader``: the one place the compiled parts are imported.

Nothing is imported or built at package import.
"""
