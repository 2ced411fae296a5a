"""The recorder backend: dispatcher-level record and replay for the CPU and any device."""

from .backend import RecorderBackend, RecorderGraphImpl

__all__ = ["RecorderBackend", "RecorderGraphImpl"]
