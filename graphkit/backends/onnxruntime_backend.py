"""What the two backends share: sessions from onnxruntime's engine, standard graphs.

:class:`OnnxruntimeBackend` is the base of a backend whose graphs run on onnxruntime's
shared engine (:mod:`graphkit.engine.ort_engine`): its sessions are the engine's, its
gradient graphs need nothing more to run or to be exported. A backend overrides what it
does differently (onnxruntime-training lowers its CPU kernels in
:meth:`inference_session`, its operators in :meth:`to_standard`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx

from graphkit.compat import NEWEST, Ceiling
from graphkit.engine import ort_engine


class OnnxruntimeBackend:
    """The engine and the defaults of a backend run by onnxruntime."""

    name: str
    description: str
    builds_for: Ceiling = NEWEST
    """The newest IR version and opset its gradient source builds graphs for."""

    @property
    def ceiling(self) -> Ceiling:
        """:attr:`builds_for`, at most what the installed onnxruntime loads
        (:func:`graphkit.engine.ort_engine.runtime_ceiling`)."""
        runtime = ort_engine.runtime_ceiling()
        return Ceiling(
            min(self.builds_for.ir_version, runtime.ir_version),
            min(self.builds_for.opset, runtime.opset),
        )

    def inference_session(
        self,
        model: onnx.ModelProto | bytes,
        providers: Sequence[ort_engine.Provider] = ort_engine.CPU,
        threads: ort_engine.Threads | None = None,
    ) -> Any:
        """An engine session running ``model``."""
        return ort_engine.inference_session(model, providers, threads)

    def to_standard(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model`` itself: its gradient graphs are standard ONNX."""
        return model

    def prepare_gradient(self, gradient: onnx.ModelProto) -> onnx.ModelProto:
        """``gradient`` itself: it runs as it is."""
        return gradient

    def __repr__(self) -> str:
        return f"<graphkit backend {self.name!r}: {self.description}>"


__all__ = ["OnnxruntimeBackend"]
