"""Host reads the dispatcher never sees: ``tolist()``, ``numpy()``, ``repr``/``print``, ...

A tensor made inside a capture holds no value yet (its kernels run at replay), so reading it on
the host returns whatever the pool memory held. ``.item()``, ``bool(t)``, ``int(t)`` reach the
dispatcher as ``aten::_local_scalar_dense`` and are refused there (:mod:`.illegal_ops`), but several
reads never dispatch an aten op that reads data: ``Tensor.tolist()`` walks the storage in C,
``numpy()`` / ``__array__`` (``numpy.asarray(t)``) hand the memory to numpy after a ``detach``,
``repr``/``str``/``print``/f-strings format with every dispatch mode switched off, and pickling
(``torch.save``, ``pickle.dumps``) copies the storage bytes. On CUDA each of these is a
device-to-host copy, which fails while a stream captures, whichever tensor it reads (one made
in the capture or one that existed before). The recorder mirrors that: during a capture, on the
capturing thread, each of these methods on a tensor of the capture's device raises
:class:`~accel_graph.errors.CaptureError` naming the read, and the capture is over (as at an
illegal op). On the CPU the host is the device, so every CPU tensor counts.

The methods are wrapped on ``torch.Tensor`` only while some capture is underway (a count, as the
generator interception of :mod:`accel_graph.backends.recorder.rng`); other threads and other devices pass straight through.
Also let through: ``repr``/``format`` called from torch's own code, which words an error it is
about to raise with the tensor (``torch.cond``'s bad-predicate message). Not intercepted:
``__dlpack__`` (an export of the memory, not a read: the consumer may be
device code, legal on CUDA) and code that bound a method before the capture began.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from ...errors import CaptureError
from . import islands
from .scoped_patch import ScopedPatch

__all__ = ["HOST_READS", "acquire", "installed", "release", "watch", "unwatch"]

_FIX = (
    "During capture a tensor holds no value yet (its kernels run at replay), and on a device "
    "this read is a device-to-host copy, which fails while a stream captures. Read it after "
    "replay(), or keep the computation on the device (torch.where, torch.cond)"
)

#: Method of ``torch.Tensor`` -> how the user calls it (for the error).
HOST_READS: dict[str, str] = {
    "tolist": "Tensor.tolist()",
    "numpy": "Tensor.numpy()",
    "__array__": "numpy.asarray(tensor) / Tensor.__array__",
    "__repr__": "repr(tensor) / str(tensor) / print(tensor)",
    "__format__": "format(tensor) / an f-string of a tensor",
    "__reduce_ex__": "pickling a tensor (torch.save, pickle.dumps)",
}

_Tensor = torch.Tensor
#: The methods as torch defines them (read once, at import: no side effect, just lookups).
_ORIGINALS: dict[str, Any] = {name: getattr(_Tensor, name) for name in HOST_READS}
#: Reads torch's own code makes to word an error it is about to raise (``cond``'s "Expected
#: pred to be bool or single-element tensor, but got {pred}"): that error says more than ours.
_MESSAGE_READS = frozenset({"__repr__", "__format__"})
_TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"
_tls = threading.local()


class _Watched:
    """What a read on this thread is checked against: the capture's device and its refusal."""

    __slots__ = ("device_type", "is_recording", "refuse", "raise_", "previous")

    def __init__(self, device_type: str | None, is_recording: Callable[[], bool],
                 refuse: Callable[[str, BaseException], None], raise_: bool,
                 previous: _Watched | None) -> None:
        self.device_type = device_type
        self.is_recording = is_recording
        self.refuse = refuse
        self.raise_ = raise_
        self.previous = previous


def watch(device_type: str | None, is_recording: Callable[[], bool],
          refuse: Callable[[str, BaseException], None], *, raise_: bool = True) -> object:
    """Check host reads on the calling thread (the capturing one) from now on: a read of a
    tensor whose device type is ``device_type`` (None: any tensor) while ``is_recording()``
    calls ``refuse(what, exc)`` and, with ``raise_`` (a capture: ``refuse`` ends it), raises
    ``exc``; without it (``check_capturable``, which only reports) the read goes on. Returns
    a token for :func:`unwatch`."""
    token = _Watched(device_type, is_recording, refuse, raise_, getattr(_tls, "watched", None))
    _tls.watched = token
    return token


def unwatch(token: object) -> None:
    """Stop checking on the calling thread if ``token`` is what it checks (what was checked
    before it is checked again). A no-op on another thread: a capture ended from elsewhere is
    seen through ``is_recording``."""
    if getattr(_tls, "watched", None) is token:
        assert isinstance(token, _Watched)
        _tls.watched = token.previous


def _check(t: Any, name: str) -> None:
    w = getattr(_tls, "watched", None)
    if w is None or not isinstance(t, _Tensor) or not w.is_recording():
        return
    if islands.running():
        return  # an eager island reads real values: its reads are legal (accel_graph.eager_island)
    if w.device_type is not None and t.device.type != w.device_type:
        return  # host memory read while capturing on a device: legal, as on CUDA
    what = HOST_READS[name]
    exc = CaptureError(
        f"{what} during capture on {t.device.type}, of a tensor of shape {tuple(t.shape)} and "
        f"dtype {t.dtype}: {_FIX}"
    )
    w.refuse(what, exc)
    if w.raise_:
        raise exc


def _wrapper(name: str) -> Callable[..., Any]:
    original = _ORIGINALS[name]

    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_tls, "watched", None) is None or getattr(_tls, "reading", False):
            return original(self, *args, **kwargs)
        if not (name in _MESSAGE_READS
                and sys._getframe(1).f_code.co_filename.startswith(_TORCH_DIR)):
            _check(self, name)
        # One read is one finding: repr formats through __format__ and tolist, and a torch
        # function mode calls the method again; those inner reads are part of this one.
        _tls.reading = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _tls.reading = False

    read.__name__ = name
    read.__qualname__ = f"Tensor.{name}"
    read.__doc__ = getattr(original, "__doc__", None)
    return read


_WRAPPERS: dict[str, Callable[..., Any]] = {name: _wrapper(name) for name in HOST_READS}


def _install() -> None:
    for name, wrapper in _WRAPPERS.items():
        if getattr(_Tensor, name) is _ORIGINALS[name]:  # ours to wrap
            setattr(_Tensor, name, wrapper)


def _uninstall() -> None:
    for name, wrapper in _WRAPPERS.items():
        if _Tensor.__dict__.get(name) is wrapper:  # leave alone what others put there
            if name in _ORIGINAL_OWN:
                setattr(_Tensor, name, _ORIGINALS[name])
            else:
                delattr(_Tensor, name)


#: Wraps the methods while some capture is underway: ``acquire()`` when a capture begins,
#: ``release()`` when it ends, ``installed()`` whether they are wrapped now.
_PATCH = ScopedPatch(_install, _uninstall)
acquire, release, installed = _PATCH.acquire, _PATCH.release, _PATCH.installed


#: Methods ``torch.Tensor`` defines itself (the others come from ``TensorBase``: deleting the
#: wrapper restores them).
_ORIGINAL_OWN = frozenset(name for name in HOST_READS if name in _Tensor.__dict__)


