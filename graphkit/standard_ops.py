"""The rewrites that leave a user's graph with operators both gradient sources
differentiate, each computing what the nodes it replaces computed, in this order:

* an ``If`` whose condition is a constant as the branch it takes
  (:func:`graphkit.constant_branches.constant_branches_taken`: onnxruntime's constant
  folding crashes on dynamo's ``nn.EmbeddingBag``);
* the common sequence patterns as tensor operators (:func:`graphkit.sequences.sequences_as_tensors`:
  dynamo's ``SplitToSequence`` + ``SequenceAt``);
* a ``CastLike`` of a known type as a ``Cast`` (:func:`graphkit.castlike.castlike_as_cast`);
* a nearest-neighbour ``Resize`` by whole factors as a broadcast, a linear one of static
  extents as products by interpolation matrices
  (:func:`graphkit.resize.resizes_as_broadcasts_or_products`: a U-Net's upsampling);
* skl2onnx's linear models as standard operators
  (:func:`graphkit.ml_ops.linear_models_as_standard_ops`);
* BatchNormalization and Dropout in their inference form, those exported in training
  mode marked to train so (:func:`graphkit.train_mode.marked_for_training`).

Both entry points apply them: :func:`graphkit.add_loss_output` and
:func:`graphkit.prepare.standard_model` (a trainer's build), after the opset
conversion.
"""

from __future__ import annotations

import onnx

from graphkit.castlike import castlike_as_cast
from graphkit.constant_branches import constant_branches_taken
from graphkit.ml_ops import linear_models_as_standard_ops
from graphkit.resize import resizes_as_broadcasts_or_products
from graphkit.sequences import sequences_as_tensors
from graphkit.train_mode import marked_for_training


def as_standard_operators(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the rewrites of the module docstring applied (a copy where one
    applies)."""
    model = castlike_as_cast(sequences_as_tensors(constant_branches_taken(model)))
    model = linear_models_as_standard_ops(resizes_as_broadcasts_or_products(model))
    return marked_for_training(model)


__all__ = ["as_standard_operators"]
