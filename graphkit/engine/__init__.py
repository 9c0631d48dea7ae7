"""The engine every backend shares: onnxruntime sessions and values on a device.

* :mod:`.ort_engine`: sessions, values, IOBinding, DLPack, and the eager
  :class:`~.ort_engine.Runner` the DSL's functions run on;
* :mod:`.cuda_splits`, :mod:`.cuda_unpools`: what a session on CUDA rewrites before it
  runs (operators onnxruntime's CUDA provider runs slowly or not at all).

It sits below the DSL and the backends: it imports only graphkit's foundation
(:mod:`graphkit.errors`, :mod:`graphkit.compat`, :mod:`graphkit._graph`,
:mod:`graphkit.runtime_check`), so that every layer above may run graphs.
"""
