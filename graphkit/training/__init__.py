"""Building training graphs: everything a training loop runs, as ONNX graphs built once.

* :mod:`.problem`: :class:`TrainingProblem`, one description of a full-training problem
  (the prepared graph, the weights, the optimizer, the backend) from which every graph
  below is built;
* :mod:`.step`: the fused training step (:func:`build_training_step`) and the update step
  of forward/backward training (:func:`build_update_step`);
* :mod:`.epoch`: many steps in one graph, the step as the body of a ``Scan``
  (:mod:`.counter`: the step's arithmetic on its counter, computed for the whole epoch;
  :mod:`.packed_carry`: packed weights carried through it);
* :mod:`.specialized`: those graphs for a fixed number of rows;
* :mod:`.trained`: the prediction graph with trained weights;
* :mod:`.export`: the portable step, epoch and ``TrainingInfoProto``
  (:mod:`.web_graphs`: what a web page trains with);
* :mod:`.batches`: an epoch's batches, as views or gathered a piece at a time.

The runtime (:mod:`graphkit_train`) runs these graphs; it builds none of its own.
"""

from graphkit.training.batches import epoch_batches
from graphkit.training.epoch import scan_over_batches
from graphkit.training.problem import TrainingProblem
from graphkit.training.specialized import for_rows
from graphkit.training.step import TrainingStep, build_training_step, build_update_step

__all__ = [
    "TrainingProblem",
    "TrainingStep",
    "build_training_step",
    "build_update_step",
    "epoch_batches",
    "for_rows",
    "scan_over_batches",
]
