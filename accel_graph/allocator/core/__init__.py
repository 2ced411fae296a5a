"""The allocator engine: the C core (built by cffi at install time), its Python face
(``engine.Engine``), PyTorch-named statistics (``stats``), the device plug-in for torch's
``CUDAPluggableAllocator`` (``plugin``), and ``loader``, the one place the compiled parts are
imported. Nothing is imported or built at package import.
"""
