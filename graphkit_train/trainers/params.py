"""What the two trainers share: the scikit-learn parameter protocol, devices, input
checks and the choice of learning rate."""

from __future__ import annotations

import inspect
import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from graphkit import optimizers, schedules
from graphkit.engine.ort_engine import CUDA_HINT, providers_for  # noqa: F401 - re-exported
from graphkit.errors import DTypeError, ShapeError, UnknownNameError
from graphkit.shapes import static_shape
from graphkit.training.batches import NamedRows
from graphkit.transforms import GradientTransformation


class ParamsMixin:
    """The scikit-learn estimator protocol, without importing scikit-learn.

    ``get_params`` / ``set_params`` from the ``__init__`` signature, ``__sklearn_tags__``
    (a classifier or a regressor, as the loss says) and ``__sklearn_is_fitted__``: so
    ``clone``, ``GridSearchCV``, ``cross_val_score`` and ``check_is_fitted`` accept the
    trainers, while ``import graphkit_train`` stays free of scikit-learn.
    """

    @classmethod
    def _param_names(cls) -> list[str]:
        signature = inspect.signature(cls.__init__)
        return [p for p in signature.parameters if p != "self"]

    def _store_params(self, values: Mapping[str, Any]) -> None:
        """Store the constructor's arguments unchanged (scikit-learn's convention: all
        validation happens in ``fit``, so ``clone`` and ``set_params`` work)."""
        for name in self._param_names():
            setattr(self, name, values[name])

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._param_names()}

    # parameters that only steer the loop: changing them keeps the built graphs and state
    _loop_params: frozenset[str] = frozenset(
        {
            "max_iter",
            "batch_size",
            "warm_start",
            "verbose",
            "validation_every",
            "shuffle",
            "random_state",
            "exc",
            "early_stopping",
            "validation_fraction",
            "n_iter_no_change",
            "tol",
            "rollback",
        }
    )

    def set_params(self, **params: Any) -> ParamsMixin:
        valid = self._param_names()
        for key, value in params.items():
            if key not in valid:
                raise ValueError(
                    f"Invalid parameter {key!r} for {type(self).__name__}; valid: {valid}."
                )
            setattr(self, key, value)
        if set(params) - self._loop_params:
            self._invalidate()
        return self

    def _invalidate(self) -> None:
        """Forget what was built from the parameters (subclasses override)."""

    def _is_classifier(self) -> bool:
        """Whether the loss takes class labels (subclasses say, without building)."""
        return False

    @property
    def _estimator_type(self) -> str:
        return "classifier" if self._is_classifier() else "regressor"

    def __sklearn_tags__(self) -> Any:
        # called by scikit-learn only, so importing it here costs nothing more
        from sklearn.utils import ClassifierTags, InputTags, RegressorTags, Tags, TargetTags

        classifier = self._is_classifier()
        return Tags(
            estimator_type="classifier" if classifier else "regressor",
            target_tags=TargetTags(required=True),
            classifier_tags=ClassifierTags(multi_class=True) if classifier else None,
            regressor_tags=None if classifier else RegressorTags(),
            input_tags=InputTags(sparse=False, allow_nan=False),
        )

    def __repr__(self) -> str:
        defaults = inspect.signature(type(self).__init__).parameters
        shown = []
        for name in self._param_names():
            value = getattr(self, name)
            if isinstance(value, onnx.ModelProto):
                shown.append(f"{name}=<ModelProto {value.graph.name!r}>")
            elif (
                defaults[name].default is inspect.Parameter.empty
                or value is not defaults[name].default
            ):
                if not (isinstance(value, (int, float, str)) and value == defaults[name].default):
                    shown.append(f"{name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"


def select_optimizer(optimizer: Any, schedule: Any = None) -> GradientTransformation:
    """The gradient transformation graphkit's trainers train with.

    ``optimizer``: a gradient transformation, or an optimizer name meaning exactly
    ``graphkit.optimizers.get(name)`` (in any case: ``"SGD"`` is ``"sgd"``).
    ``schedule`` (a Schedule, a schedule name or a float) fills its open learning rate;
    None leaves an open rate at a constant
    :data:`~graphkit.optimizers.DEFAULT_LEARNING_RATE` (0.01).
    """
    if isinstance(optimizer, str):
        optimizer = optimizers.get(optimizer)
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            "optimizer must be a graphkit gradient transformation or an optimizer name "
            f"({', '.join(optimizers.OPTIMIZERS.names())}), not {optimizer!r}; the seed's "
            "LearningRate* objects go to the seed trainers' learning_rate= (or pass "
            "rate.to_transformation())."
        )
    if schedule is not None:
        if not optimizer.has_open_learning_rate:
            raise ValueError(
                f"{optimizer!r} has its learning rate already; schedule= fills an open one "
                "(build the optimizer without learning_rate=)."
            )
        return optimizer.with_learning_rate(schedules.get(schedule))
    from graphkit.seed import resolve

    return resolve(optimizer)


def select_learning_rate(learning_rate: Any) -> GradientTransformation:
    """The gradient transformation a seed trainer's ``learning_rate`` stands for: None
    (the seed's default, :class:`graphkit.seed.LearningRateSGD`: SGD with the
    invscaling schedule), a float (plain SGD at that constant rate), an optimizer name
    (graphkit's, as in :func:`select_optimizer`: ``"SGD"`` is constant-rate SGD), a
    graphkit transformation (an open rate runs at a constant 0.01), a
    ``(transformation, schedule or float)`` pair, or a ``LearningRate*`` object; see
    :func:`graphkit.seed.resolve`."""
    from graphkit.seed import LearningRateSGD, resolve

    if learning_rate is None:
        learning_rate = LearningRateSGD()
    return resolve(learning_rate)


def input_value(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    return next(i for i in model.graph.input if i.name == name)


def check_features(
    X: Any, value: onnx.ValueInfoProto, what: str = "X", owner: str = "the model"
) -> np.ndarray:
    """X as a C-contiguous array of the graph input's dtype; clear errors otherwise.

    Integer, boolean or other-precision float features are cast to the input's dtype
    (documented); the messages follow scikit-learn's wording where it has one.
    """
    if type(X).__module__.startswith("scipy.sparse"):
        raise TypeError(
            f"{what} is a sparse matrix; an ONNX graph takes dense tensors. Pass "
            f"{what}.toarray() (or densify it batch by batch for large data)."
        )
    X = as_array(X, what)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))
    if X.dtype.kind == "c":
        raise ValueError(f"Complex data not supported: {what} is {X.dtype}.")
    if X.dtype.kind == "O":
        X = objects_as_numbers(X, what)  # numbers stored as objects (a mixed data frame)
    if X.dtype.kind not in "iufb":
        raise DTypeError(_not_numeric_message(X, what))
    dims = static_shape(value) or []
    if X.ndim != len(dims) or X.ndim == 0:
        hint = (
            f"; Reshape your data: {what}.reshape(-1, 1) for one feature, "
            f"{what}.reshape(1, -1) for one sample"
            if X.ndim == 1 and len(dims) == 2
            else ""
        )
        raise ShapeError(
            f"{what} must have {len(dims)} dimensions (input {value.name!r} is {dims}), "
            f"got shape {X.shape}{hint}."
        )
    if len(X) == 0:
        raise ValueError(
            f"Found array with 0 sample(s) (shape={X.shape}) while a minimum of 1 is required: "
            f"{what} is empty, there is nothing to train on."
        )
    if X.ndim == 2 and X.shape[1] == 0:
        raise ValueError(
            f"Found array with 0 feature(s) (shape={X.shape}) while a minimum of 1 is required."
        )
    # (a float64 copy of float32 data would double the peak memory for this check)
    if X.dtype.kind == "f" and not np.isfinite(X).all():
        row = int(np.argwhere(~np.isfinite(X))[0][0])
        raise ValueError(
            f"{what} contains NaN or infinity (first at row {row}); clean or impute it."
        )
    if dtype.kind in "iu" and X.dtype.kind == "f" and not np.array_equal(X, np.round(X)):
        row = int(np.argwhere(X != np.round(X))[0][0])
        raise DTypeError(
            f"{what} holds non-integer values (first at row {row}), but input {value.name!r} "
            f"is {dtype} (ids or categories): pass integers, {what}.astype(numpy.{dtype})."
        )
    for axis, (expected, got) in enumerate(zip(dims, X.shape)):
        if axis and isinstance(expected, int) and expected != got:
            if axis == 1 and X.ndim == 2:
                raise ShapeError(
                    f"{what} has {got} features, but {owner} is expecting {expected} features "
                    f"as input (the graph's input {value.name!r} is {dims})."
                )
            raise ShapeError(
                f"{what} has {got} values on axis {axis}; {owner} expects {expected} "
                f"(input {value.name!r} is {dims})."
            )
    return np.ascontiguousarray(X, dtype=dtype)


def as_array(X: Any, what: str = "X") -> np.ndarray:
    """``numpy.asarray(X)``, with a :class:`ShapeError` naming the row where nested lists
    are ragged (``[[1.0, 2.0], [3.0]]``) instead of numpy's "inhomogeneous shape"."""
    try:
        return np.asarray(X)
    except ValueError as exc:
        ragged = _ragged(X)
        if ragged is None:
            raise
        raise ShapeError(_ragged_message(what, *ragged)) from exc


_ENCODE_HINT = (
    "Encode text or categories as numbers first (sklearn.preprocessing.OrdinalEncoder or "
    "OneHotEncoder), or drop those columns."
)


def objects_as_numbers(
    X: np.ndarray, what: str = "X", prefix: str = "", fix: str = _ENCODE_HINT
) -> np.ndarray:
    """An object array (numbers kept as Python objects: a data frame with mixed columns)
    as float64.

    Raises:
        DTypeError: a cell is not a number (a string, None, a dict...); the message names
            its row (and column), and keeps Python's own words ("float() argument must be
            a string or a real number") after ``prefix``.
        ShapeError: a cell is a sequence (rows of different lengths); the message names
            the row.
    """
    try:
        return X.astype(np.float64)
    except (TypeError, ValueError) as exc:
        for index in np.ndindex(X.shape):
            cell = X[index]
            if isinstance(cell, (list, tuple)) or (isinstance(cell, np.ndarray) and cell.ndim):
                ragged = _ragged(X.tolist())
                if ragged is not None:
                    raise ShapeError(_ragged_message(what, *ragged)) from None
                raise ShapeError(
                    f"{what} holds a sequence of {len(cell)} values at "
                    f"{_position(index, what)}, where a number is expected: pass one number "
                    "per cell (numpy.stack the rows if they are arrays)."
                ) from None
            try:
                float(cell)
            except (TypeError, ValueError) as cell_exc:
                raise DTypeError(
                    f"{prefix}{what} holds {cell!r} (a {type(cell).__name__}) at "
                    f"{_position(index, what)}, where a number is expected ({cell_exc}). "
                    f"{fix}"
                ) from None
        raise DTypeError(
            f"{prefix}{what} holds objects that are not numbers ({exc}). {fix}"
        ) from None


def _position(index: tuple[int, ...], what: str) -> str:
    """Where a cell is, in words: "row 3", "row 3, column 1", "row 3, X[3, 1, 2]"."""
    if len(index) == 1:
        return f"row {index[0]}"
    if len(index) == 2:
        return f"row {index[0]}, column {index[1]}"
    return f"row {index[0]}, {what}[{', '.join(map(str, index))}]"


def _not_numeric_message(X: np.ndarray, what: str) -> str:
    """Why an array of another kind than numbers (text, dates...) is refused: for text,
    the first cell that is no number (its row and column), or that every cell is a
    number written as text."""
    message = f"{what} must be numeric, got dtype {X.dtype}"
    if X.dtype.kind not in "US":
        return f"{message}. {_ENCODE_HINT}"
    try:
        X.astype(np.float64)
    except (TypeError, ValueError):
        for index in np.ndindex(X.shape):
            try:
                float(X[index])
            except (TypeError, ValueError):
                return (
                    f"{message}: it holds {X[index].item()!r} at {_position(index, what)}, "
                    f"where a number is expected. {_ENCODE_HINT}"
                )
    return f"{message}: numbers written as text; pass {what}.astype(numpy.float32)."


def _length(value: Any) -> int | None:
    """The length of a row that is a sequence; None for a scalar (a string is one)."""
    if isinstance(value, (str, bytes, Mapping)):
        return None
    if isinstance(value, np.ndarray):
        return len(value) if value.ndim else None
    try:
        return len(value)
    except TypeError:
        return None


def _ragged(
    rows: Any, path: tuple[int, ...] = ()
) -> tuple[tuple[int, ...], int | None, int | None] | None:
    """The first place where nested sequences differ in length: ``(index of the odd
    one, its length, the length of the first sibling)`` (None for a single value), or
    None when they do not."""
    if _length(rows) is None:
        return None
    lengths = [_length(row) for row in rows]
    for i, length in enumerate(lengths):
        if length != lengths[0]:
            return (*path, i), length, lengths[0]
    if not lengths or lengths[0] is None:
        return None
    for i, row in enumerate(rows):
        found = _ragged(row, (*path, i))
        if found is not None:
            return found
    return None


def _ragged_message(
    what: str, index: tuple[int, ...], length: int | None, first: int | None
) -> str:
    """Where nested lists are ragged: the odd one at ``index`` (``length`` values, None
    for a single number) and its first sibling (``first`` values)."""

    def count(n: int | None) -> str:
        return "is a single number" if n is None else f"has {n} value{'s' if n != 1 else ''}"

    if len(index) == 1:
        place, sibling = f"row {index[0]}", "row 0"
    else:
        inner = "".join(f"[{i}]" for i in index[:-1])
        place = f"{what}{inner}[{index[-1]}] (row {index[0]})"
        sibling = f"{what}{inner}[0]"
    return (
        f"{what} is ragged: {place} {count(length)} where {sibling} {count(first)}; "
        "every row must have the same number of values (pad the short rows, or drop them)."
    )


def feature_names(X: Any) -> np.ndarray | None:
    """The column names of a data frame ``X`` when they are all strings, as an object
    array; None for anything else (an array, a dict of inputs, a frame with integer
    column names). scikit-learn's rule (``feature_names_in_``), without importing pandas:
    a pandas DataFrame, or any frame with the interchange protocol (``__dataframe__``:
    polars, pyarrow...).

    Raises:
        TypeError: the names mix strings and other types (as scikit-learn).
    """
    pandas = sys.modules.get("pandas")  # loaded already if X is one of its frames
    if pandas is not None and isinstance(X, pandas.DataFrame):
        names = np.asarray(X.columns, dtype=object)
    elif hasattr(X, "__dataframe__") and not isinstance(X, Mapping):
        names = np.asarray(list(X.__dataframe__().column_names()), dtype=object)
    else:
        return None
    if not len(names):
        return None
    types = sorted({type(name).__qualname__ for name in names})
    if len(types) > 1 and "str" in types:
        raise TypeError(
            "Feature names are only supported if all input features have string names, but "
            f"your input has {types} as feature name / column name types. Convert them all "
            "to strings (X.columns = X.columns.astype(str)), or pass X.to_numpy()."
        )
    return names if types == ["str"] else None


def check_feature_names(
    fitted: np.ndarray | None, X: Any, owner: str, what: str = "X", stacklevel: int = 4
) -> None:
    """Refuse a data frame ``X`` whose column names are not ``fitted`` (the trainer's
    ``feature_names_in_``) in the same order: the graph reads columns by position, so a
    frame with its columns reordered would predict from the wrong features. Raises, as
    scikit-learn does, rather than reordering; warns as scikit-learn does when only one
    of them has names (``stacklevel`` 4: at the caller of the method that calls this).

    Raises:
        ValueError: scikit-learn's message ("The feature names should match those that
            were passed during fit."), listing the unexpected and the missing names, or
            saying the order differs; then how to select the columns.
    """
    names = feature_names(X)
    if fitted is None and names is None:
        return
    if fitted is None:
        warnings.warn(
            f"{what} has feature names, but {owner} was fitted without feature names",
            UserWarning,
            stacklevel=stacklevel,
        )
        return
    if names is None:
        warnings.warn(
            f"{what} does not have valid feature names, but {owner} was fitted with feature names",
            UserWarning,
            stacklevel=stacklevel,
        )
        return
    if len(names) == len(fitted) and (names == fitted).all():
        return
    unexpected = sorted(set(names) - set(fitted))
    missing = sorted(set(fitted) - set(names))

    def listed(found: list[str]) -> str:
        shown = "".join(f"- {name}\n" for name in found[:5])
        return shown + ("- ...\n" if len(found) > 5 else "")

    message = "The feature names should match those that were passed during fit.\n"
    if unexpected:
        message += "Feature names unseen at fit time:\n" + listed(unexpected)
    if missing:
        message += "Feature names seen at fit time, yet now missing:\n" + listed(missing)
    if not unexpected and not missing:
        message += "Feature names must be in the same order as they were in fit.\n"
    raise ValueError(
        message + f"{owner} reads the columns of {what} by position: pass them as fitted, "
        f"{what}[trainer.feature_names_in_] (the {len(fitted)} columns "
        f"{list(fitted[:5])}{'...' if len(fitted) > 5 else ''})."
    )


def check_inputs(
    X: Any, values: Sequence[onnx.ValueInfoProto], what: str = "X", owner: str = "the model"
) -> np.ndarray | NamedRows:
    """The features of a model with the graph inputs ``values``, checked (see
    :func:`check_features`): one array for one input, :class:`NamedRows` for several.

    ``X`` is an array for a one-input model, or ``{input name: array}`` (as
    onnxruntime's feeds) for any model; every array has the same rows.

    Raises:
        ShapeError: one array for a model with several inputs (the message names them and
            says to pass a dict), or arrays with different numbers of rows.
        UnknownNameError: a dict missing an input or naming one the model does not have.
    """
    names = [v.name for v in values]
    if isinstance(X, NamedRows):  # checked already (compute_loss checks twice)
        X = X.arrays
    sparse = type(X).__module__.startswith("scipy.sparse")  # a dok_matrix is a dict
    if sparse or not isinstance(X, Mapping):
        if len(values) == 1 or sparse:
            return check_features(X, values[0], what, owner)
        raise ShapeError(
            f"{what} is one array, but the model takes {len(names)} inputs {names}: pass a dict "
            f"{{input name: array}}, e.g. {what}={{"
            + ", ".join(f"{n!r}: ..." for n in names)
            + "}, each with one row per sample (as onnxruntime's feeds)."
        )
    missing = [n for n in names if n not in X]
    unknown = [k for k in X if k not in names]
    if missing or unknown:
        problems = []
        if missing:
            problems.append(f"it has no array for {missing}")
        if unknown:
            problems.append(f"{unknown} {'is' if len(unknown) == 1 else 'are'} no input")
        raise UnknownNameError(
            f"{what} names {list(X)}: {' and '.join(problems)}. The model's inputs are "
            f"{names}; pass one array for each."
        )
    arrays = {v.name: check_features(X[v.name], v, f"{what}[{v.name!r}]", owner) for v in values}
    rows = {name: len(a) for name, a in arrays.items()}
    if len(set(rows.values())) != 1:
        raise ShapeError(
            f"The arrays of {what} must have one row per sample each; they have {rows} rows."
        )
    return arrays[names[0]] if len(arrays) == 1 else NamedRows(arrays)


def check_labels(y: Any, value: onnx.ValueInfoProto, n: int, what: str = "y") -> np.ndarray:
    """y shaped and typed as the label input; clear errors otherwise.

    Labels of one value per sample, or shaped like the prediction, are reshaped to the
    input's declared shape; int64 labels declared with rank > 1 (a class per token:
    ``token_cross_entropy``, a custom loss's) keep their shape, which must be the input's.
    """
    if y is None:
        raise ValueError(
            "This estimator requires y to be passed, but the target y is None: fit(X, y)."
        )
    y = as_array(y, what)
    if y.dtype.kind == "O":
        y = objects_as_numbers(
            y,
            what,
            "Unknown label type: ",
            "Encode the labels as numbers first (sklearn.preprocessing.LabelEncoder for classes).",
        )
    elem = value.type.tensor_type.elem_type
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    if len(y) != n:
        raise ShapeError(f"X has {n} rows but {what} has {len(y)}; they must match.")
    if dtype.kind == "i":
        if y.dtype.kind not in "iu":
            raise DTypeError(
                f"The loss is a classification loss and needs integer class labels; {what} is "
                f"{y.dtype}. Pass {what}.astype(numpy.int64)."
            )
    else:
        if y.dtype.kind not in "iuf":
            raise DTypeError(
                f"The loss is a regression loss and needs numeric targets; {what} is "
                f"{y.dtype}. Pass {what}.astype(numpy.{dtype}) (or train with a "
                "classification loss)."
            )
        if y.dtype.kind == "f" and not np.isfinite(y).all():
            raise ValueError(f"{what} contains NaN or infinity; clean it before training.")
    dims = static_shape(value) or []
    if dtype.kind == "i" and len(dims) > 1:
        return _labels_by_position(y, value.name, dims, n, what)
    target = [n if i == 0 else d for i, d in enumerate(dims)]
    if all(isinstance(d, int) for d in target):
        if math.prod(target) != y.size:  # type: ignore[arg-type]
            raise ShapeError(_label_shape_message(what, y.shape, value.name, dims, target))
        y = y.reshape(target)
    elif len(dims) == 2 and y.ndim == 1:
        y = y.reshape(-1, 1)
    return np.ascontiguousarray(y, dtype=dtype)


def _labels_by_position(y: np.ndarray, name: str, dims: list[Any], n: int, what: str) -> np.ndarray:
    """int64 labels of rank > 1, their shape kept: their rank and the known dims of the
    label input ``name`` (declared ``dims``) must match."""
    expected = (n, *dims[1:])
    fits = y.ndim == len(dims) and all(
        not isinstance(d, int) or d == got for d, got in zip(expected, y.shape)
    )
    if not fits:
        shown = "(" + ", ".join(str(d) if isinstance(d, int) else d or "?" for d in expected)
        raise ShapeError(
            f"{what} has shape {y.shape}, but the label input {name!r} is {dims}: one class "
            f"label per position (token labels (N, T) for (N, T, V) logits); pass {what} of "
            f"shape {shown})."
        )
    return np.ascontiguousarray(y, dtype=np.int64)


def _label_shape_message(
    what: str, shape: tuple[int, ...], name: str, dims: list[Any], target: list[Any]
) -> str:
    """Why labels of ``shape`` do not fit the label input ``name`` declared ``dims``."""
    if len(dims) == 1:
        return (
            f"{what} has shape {shape}, but the label input {name!r} is {dims}: one value per "
            f"sample; pass {what} of shape {tuple(target)}."
        )
    per_sample = math.prod(target[1:])
    values = f"{per_sample} value{'s' if per_sample != 1 else ''}"
    either = f" or ({target[0]},)" if per_sample == 1 else ""
    return (
        f"{what} has shape {shape}, but the label input {name!r} is {dims}, shaped like the "
        f"model's prediction: {values} per sample. Pass {what} of shape {tuple(target)}"
        f"{either}, or train a model that predicts {shape[1] if len(shape) == 2 else 'as many'} "
        "values per sample."
    )


def check_label_width(what: str, y: np.ndarray, prediction: np.ndarray) -> None:
    """Refuse labels ``y`` whose values per sample differ from the prediction's
    (``prediction`` computed on a few rows: for a model whose declared output does not
    say its width).

    Raises:
        ShapeError: naming both shapes.
    """
    if math.prod(y.shape[1:]) != math.prod(prediction.shape[1:]):
        raise ShapeError(
            f"{what} has shape {y.shape}, but the model predicts shape "
            f"{(len(y), *prediction.shape[1:])} for {len(y)} samples: a regression loss "
            f"needs one label per predicted value; pass {what} shaped like the prediction."
        )


def check_label_positions(what: str, y: np.ndarray, prediction: np.ndarray) -> None:
    """Refuse token labels ``y`` whose positions differ from the prediction's, its shape
    without the last (class) axis (``prediction`` computed on a few rows: the declared
    output does not say its sequence length).

    Raises:
        ShapeError: naming both shapes and the one to pass.
    """
    if y.shape[1:] != prediction.shape[1:-1]:
        raise ShapeError(
            f"{what} has shape {y.shape}, but the model predicts shape "
            f"{(len(y), *prediction.shape[1:])} for {len(y)} samples: token labels are the "
            f"prediction's shape without its last (class) axis; pass {what} of shape "
            f"{(len(y), *prediction.shape[1:-1])}."
        )


def check_loop_param(name: str, value: Any, minimum: int = 1) -> int:
    """An integer parameter (a numpy integer too, as grids built with numpy.arange give)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


def check_sample_weight(sample_weight: Any, n: int, dtype: npt.DTypeLike) -> np.ndarray:
    w = np.asarray(sample_weight, dtype=dtype).reshape(-1)
    if len(w) != n:
        raise ShapeError(f"X has {n} rows but sample_weight has {len(w)}.")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("sample_weight must be finite and non-negative.")
    if n and not w.any():
        raise ValueError("sample_weight is zero for every sample: there is nothing to learn from.")
    return w


def validation_period(validation_every: float | int | None, max_iter: int) -> int:
    """Epochs between validations: a fraction of ``max_iter`` or a count; 0 means never."""
    if not validation_every:
        return 0
    if isinstance(validation_every, float) and validation_every < 1:
        return max(1, round(validation_every * max_iter))  # never 0: no division by zero
    return max(1, int(validation_every))


def as_state(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in state.items()}
