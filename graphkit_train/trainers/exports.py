"""What a trainer exports of its model: the prediction graph with the trained weights
(:meth:`ModelExports.get_trained_onnx`), every graph it runs
(:meth:`ModelExports.save_onnx_graph`), and what the exporters of
:mod:`graphkit.training.export` and :mod:`graphkit_train.web.export` take from it
(:meth:`ModelExports.fitted_state`, :meth:`ModelExports.prediction_template`,
:meth:`ModelExports.class_count`, ``backend_``).

The graphs themselves are written by graphkit (:mod:`graphkit.training.trained`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from graphkit import lora, tensor_store
from graphkit.compat import load_model
from graphkit.tied_weights import shared_as_trained
from graphkit.training.trained import trained_weights, untied_prediction, with_weights
from graphkit.update_step import UpdateStep

if TYPE_CHECKING:
    from graphkit.backends.base import Backend
    from graphkit_train.distributed import ProcessGroup
    from graphkit_train.trainers.heads import Head


class ModelExports:
    """The trained model and the graphs a trainer runs, exported (see the module
    docstring).

    The trainer provides ``_build``, ``_fitted``, ``get_state``, ``update_step_``,
    ``untie_shared_weights``, ``tie_weights``, ``_backend``, ``_prediction_model`` and
    ``_graphs``.
    """

    # what the trainer provides, declared for the type checker (none exists at run time)
    update_step_: UpdateStep
    _backend: Backend
    _group: ProcessGroup | None

    if TYPE_CHECKING:

        @property
        def _fitted(self) -> bool: ...

        def _build(self) -> None: ...

        def get_state(self) -> dict[str, np.ndarray]: ...

        def _prediction_model(self) -> onnx.ModelProto: ...

        def _graphs(self) -> dict[str, onnx.ModelProto]: ...

        def _is_classifier(self) -> bool: ...

        def _n_classes(self, head: Head | None = None) -> int: ...

    @property
    def backend_(self) -> Backend:
        """The backend the trainer was built with (:func:`graphkit.backends.get` of
        ``backend``): its gradient source, what runs the graphs, and the lowering of its
        operators to standard ONNX."""
        self._build()
        return self._backend

    def fitted_state(self) -> dict[str, np.ndarray] | None:
        """``get_state()`` once fitted (or given a state with ``set_state``), else None
        (the exporters then write the initial weights)."""
        self._build()
        return self.get_state() if self._fitted else None

    def prediction_template(self) -> onnx.ModelProto:
        """The prediction graph with its initial weights, shared weights untied as
        training unties them (``untie_shared_weights``): the graph the trained weights are
        written into (:func:`graphkit.training.trained.with_weights`)."""
        self._build()
        return self._untied(self._prediction_model())

    def class_count(self) -> int | None:
        """The number of classes of a classification loss (labels ``0 .. K-1``; 2 for
        one probability or score column), None for a regression (or a loss per
        output)."""
        return int(self._n_classes()) if self._is_classifier() else None

    def get_trained_onnx(
        self, model: onnx.ModelProto | None = None, ema: bool = False
    ) -> onnx.ModelProto:
        """The prediction graph (or ``model``, e.g. the original one) with the trained
        weights, or with their moving average when ``ema`` (the optimizer's chain must
        end with :func:`graphkit.transforms.ema`).

        A self-contained ModelProto, its weights inside; for a model of gigabytes,
        :meth:`save_onnx_graph` writes them beside the graph instead, without that copy.
        """
        return tensor_store.inline(self._trained_model(model, ema))

    def save_trained_onnx(
        self, path: str | os.PathLike[str], model: onnx.ModelProto | None = None, ema: bool = False
    ) -> str:
        """Write :meth:`get_trained_onnx` to ``path`` without holding it in one protobuf:
        a model that came with external data, or holds more than 1 GB of weights, gets
        its weights in ``<file name>.data`` beside it (onnxruntime and ``onnx.load``
        read it from any working directory); frozen weights are copied from their file
        as they are. Returns ``path``.

        Raises:
            ValueError: the data file is the one the weights are mapped from.
        """
        path = os.fspath(path)
        tensor_store.save_model(self._trained_model(model, ema), path)
        return path

    def _trained_model(
        self, model: onnx.ModelProto | None = None, ema: bool = False
    ) -> onnx.ModelProto:
        """:meth:`get_trained_onnx`, its frozen weights still mapped from their file
        (:mod:`graphkit.tensor_store`): what the exporters write without copying them."""
        self._build()
        weights = trained_weights(self.get_state(), self.update_step_.model_state, ema)
        target = self._untied(self._prediction_model() if model is None else load_model(model))
        return with_weights(target, weights)

    def _untied(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model`` with the copies of shared weights that training made (see
        ``untie_shared_weights``) and the ties it made (``tie_weights``), so that every
        trained weight is one of its initializers."""
        tie = getattr(self, "tie_weights", False)
        untie = getattr(self, "untie_shared_weights", False)
        if tie:
            return shared_as_trained(model, self.update_step_.weights, tie, untie)
        if not untie:
            return model
        return untied_prediction(model, self.update_step_.weights)

    def lora_state(self) -> dict[str, np.ndarray]:
        """The LoRA adapters' values (trained once fitted), in the graph's layout
        (:func:`graphkit.lora.lora_state`).

        Raises:
            graphkit.lora.LoraError: the model has no adapters (:func:`graphkit.lora.add_lora`).
        """
        return lora.lora_state(self.prediction_template(), self.fitted_state())

    def save_adapter(
        self,
        path: str | os.PathLike[str],
        format: str = "onnxruntime",
        **options: Any,  # noqa: A002
    ) -> str:
        """Write the LoRA adapters alone (trained once fitted), in onnxruntime's adapter
        format or PEFT's (:func:`graphkit.lora.save_adapter`, which takes ``options``).
        Returns the path written.

        Raises:
            graphkit.lora.LoraError: the model has no adapters, or PEFT's format cannot
                name them.
        """
        return lora.save_adapter(
            self.prediction_template(), path, format, self.fitted_state(), **options
        )

    def save_onnx_graph(self, export: str | os.PathLike[str] | type[bytes]) -> dict[str, Any]:
        """Export every graph the trainer uses.

        Args:
            export: a folder (created if needed) or the type ``bytes`` to serialize in
                memory.

        Returns:
            ``{name: path}`` or ``{name: serialized bytes}``; once trained, ``trained``
            is the prediction graph with the trained weights. In distributed training
            only rank 0 writes files (the other ranks return ``{}``).

        A graph that came with external data, or holds more than 1 GB of weights, is
        written with its weights in ``<name>.onnx.data`` beside it (onnxruntime and
        ``onnx.load`` read it from any working directory); the others are one file.

        Raises:
            ValueError: ``bytes`` for a graph past protobuf's 2 GB (write it to a folder).
        """
        self._build()
        group = getattr(self, "_group", None)
        if group is not None and group.rank != 0 and export is not bytes:
            return {}
        graphs = self._graphs()
        if self._fitted:
            graphs["trained"] = self._trained_model()
        if export is bytes:
            return {name: _serialized(tensor_store.inline(g)) for name, g in graphs.items()}
        folder = os.fspath(export)  # type: ignore[arg-type]
        os.makedirs(folder, exist_ok=True)
        paths = {}
        for name, graph in graphs.items():
            paths[name] = os.path.join(folder, f"{name}.onnx")
            tensor_store.save_model(graph, paths[name])
        return paths


def _serialized(model: onnx.ModelProto) -> bytes:
    if model.ByteSize() > tensor_store.PROTOBUF_LIMIT:
        raise ValueError(
            f"A graph of {model.ByteSize() / 2**30:.2f} GiB cannot be serialized in memory "
            "(protobuf's limit is 2 GiB): pass save_onnx_graph a folder, which writes its "
            "weights as external data."
        )
    return model.SerializeToString()
