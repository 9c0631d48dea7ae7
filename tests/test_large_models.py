"""Models whose weights live in external data: mapped, never copied into a protobuf.

The references are numpy (the SGD step from its formula, the prediction from the
weights read straight from the data file) and the same model trained from an inline
ModelProto. The last test trains a model just over protobuf's 2 GB limit.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import INSTALLED_BACKENDS
from onnx import TensorProto, helper, numpy_helper

from graphkit import tensor_store
from graphkit.compat import load_model
from graphkit.errors import IncompatibleModelError, InsufficientMemoryError
from graphkit_train import ForwardBackwardTrainer, Trainer, checkpoint, memory

DIM, CLASSES, TOKENS = 256, 4, 8
BACKENDS = INSTALLED_BACKENDS


def embedding_model(vocabulary: int, seed: int = 0) -> onnx.ModelProto:
    """Token ids [N, 8] -> mean of their embeddings [N, 256] -> logits [N, 4]."""
    rng = np.random.default_rng(seed)
    table = (rng.standard_normal((vocabulary, DIM), dtype=np.float32) * 0.1).astype(np.float32)
    head = (rng.standard_normal((DIM, CLASSES)) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "X"], ["embedded"]),
            helper.make_node("ReduceMean", ["embedded", "axes"], ["pooled"], keepdims=0),
            helper.make_node("MatMul", ["pooled", "head"], ["Y"]),
        ],
        "embedding",
        [helper.make_tensor_value_info("X", TensorProto.INT64, ["N", TOKENS])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", CLASSES])],
        [
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(head, "head"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def save_external(model: onnx.ModelProto, folder) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = str(folder / "model.onnx")
    onnx.save_model(
        model, path, save_as_external_data=True, location="model.onnx.data", size_threshold=1024
    )
    return path


def table_of(path: str, vocabulary: int) -> np.ndarray:
    """The embedding table read from the data file, without graphkit."""
    model = onnx.load(path, load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name == "table")
    entries = {e.key: e.value for e in tensor.external_data}
    offset = int(entries.get("offset", 0))
    data = os.path.join(os.path.dirname(path), entries["location"])
    return np.fromfile(data, np.float32, vocabulary * DIM, offset=offset).reshape(vocabulary, DIM)


def softmax_cross_entropy_step(pooled, head, y, lr):
    """The head after one SGD step on the mean cross-entropy (numpy, from the formula)."""
    logits = pooled @ head
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    return head - lr * pooled.T @ p / len(y)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 2 MiB embedding table (mapped: at least tensor_store.MAP_FROM_BYTES) and data."""
    vocabulary = 2048
    path = save_external(embedding_model(vocabulary), tmp_path_factory.mktemp("small"))
    rng = np.random.default_rng(1)
    X = rng.integers(0, vocabulary, size=(64, TOKENS)).astype(np.int64)
    y = rng.integers(0, CLASSES, size=64).astype(np.int64)
    return path, vocabulary, X, y


def trainer(model, weights=None, backend="native", **kw):
    settings = dict(loss="cross_entropy", max_iter=1, batch_size=64, shuffle=False)
    settings.update(kw)
    return Trainer(model, weights, optimizer="sgd", schedule=0.5, backend=backend, **settings)


def test_large_external_tensors_stay_in_their_file(small):
    path, vocabulary, _, _ = small
    model = load_model(path)
    stored = {t.name for t in model.graph.initializer if tensor_store.is_stored(t)}
    assert stored == {"table"}  # the head (4 KiB) is read inline
    assert model.ByteSize() < 10_000  # the 2 MiB table is not in the protobuf
    np.testing.assert_array_equal(
        tensor_store.tensor_value(model.graph.initializer[0]), table_of(path, vocabulary)
    )
    # onnx's checker and onnxruntime see a valid model, the table shared, not copied
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    X = np.array([[0, 1, 2, 3, 4, 5, 6, 7]], np.int64)
    ours = trainer(path, ["head"]).fit(*small[2:]).predict_proba(X)
    assert ours.shape == (1, CLASSES)
    assert session.run(None, {"X": X})[0].shape == (1, CLASSES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_frozen_mapped_base_trains_its_head_as_numpy_says(small, backend):
    path, vocabulary, X, y = small
    fitted = trainer(path, ["head"], backend=backend).fit(X, y)
    table = table_of(path, vocabulary)
    head0 = numpy_helper.to_array(onnx.load(path).graph.initializer[1])
    expected = softmax_cross_entropy_step(table[X].mean(1), head0, y, 0.5)
    np.testing.assert_allclose(fitted.get_state()["head"], expected, rtol=1e-5, atol=1e-7)
    assert "table" not in fitted.get_state()  # frozen: no buffer, no optimizer state
    # the graphs the sessions run hold the table as a mapped tensor, not its bytes
    assert fitted.training_step_.model.ByteSize() < 200_000


def sgd_epochs(table, head, X, y, lr, batch, epochs):
    """Full SGD of table and head (numpy, from the formulas): the embedding's gradient
    is the pooled gradient / 8 added to each row a token read."""
    table, head = table.copy(), head.copy()
    for _ in range(epochs):
        for start in range(0, len(X), batch):
            xb, yb = X[start : start + batch], y[start : start + batch]
            pooled = table[xb].mean(1)
            logits = pooled @ head
            p = np.exp(logits - logits.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            p[np.arange(len(yb)), yb] -= 1
            d_logits = p / len(yb)
            d_pooled = d_logits @ head.T
            head -= lr * pooled.T @ d_logits
            grad = np.zeros_like(table)
            np.add.at(grad, xb.reshape(-1), np.repeat(d_pooled / TOKENS, TOKENS, axis=0))
            table -= lr * grad
    return table, head


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("steps", ["epoch", "epoch, batch by batch", 1])
def test_a_mapped_table_trains_as_numpy_says(small, backend, steps, monkeypatch):
    from graphkit_train.trainers import full

    path, vocabulary, X, y = small
    if steps == "epoch, batch by batch":  # the choice made for trained values of 64 MiB
        monkeypatch.setattr(full, "SCAN_UP_TO_BYTES", 1)
        steps = "epoch"
    fitted = trainer(path, backend=backend, max_iter=2, batch_size=16, steps_per_run=steps)
    fitted.fit(X, y)
    head0 = numpy_helper.to_array(onnx.load(path).graph.initializer[1])
    table, head = sgd_epochs(table_of(path, vocabulary), head0, X, y, 0.5, 16, 2)
    np.testing.assert_allclose(fitted.get_state()["head"], head, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fitted.get_state()["table"], table, rtol=1e-5, atol=1e-6)
    # the step scatters the read rows into the table: no table-sized zeros or gradient
    runner = next(iter(fitted._fused_runners.values()))
    specialized = runner.scan_model if runner.scan is not None else runner.model
    kinds = {n.op_type for n in specialized.graph.node}
    for body in (a.g for n in specialized.graph.node for a in n.attribute if a.HasField("g")):
        kinds |= {n.op_type for n in body.node}
    assert "ScatterND" in kinds and "ConstantOfShape" not in kinds and "GatherGrad" not in kinds


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mapped_model_trains_as_the_same_model_inline(small, backend):
    path, _, X, y = small
    mapped = trainer(path, backend=backend, max_iter=3, batch_size=16).fit(X, y)
    inline = trainer(onnx.load(path), backend=backend, max_iter=3, batch_size=16).fit(X, y)
    for name, value in inline.get_state().items():
        np.testing.assert_allclose(mapped.get_state()[name], value, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(mapped.train_losses_, inline.train_losses_, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_backward_training_takes_a_mapped_model(small, backend):
    path, vocabulary, X, y = small
    settings = dict(
        loss="cross_entropy", optimizer="sgd", schedule=0.5, max_iter=1, batch_size=64,
        shuffle=False, backend=backend,
    )  # fmt: skip
    fitted = ForwardBackwardTrainer(path, ["head"], **settings).fit(X, y)
    table = table_of(path, vocabulary)
    head0 = numpy_helper.to_array(onnx.load(path).graph.initializer[1])
    expected = softmax_cross_entropy_step(table[X].mean(1), head0, y, 0.5)
    np.testing.assert_allclose(fitted.get_state()["head"], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_backward_training_trains_a_mapped_table(small, backend):
    path, vocabulary, X, y = small
    settings = dict(
        loss="cross_entropy", optimizer="sgd", schedule=0.5, max_iter=2, batch_size=16,
        shuffle=False, backend=backend,
    )  # fmt: skip
    fitted = ForwardBackwardTrainer(path, **settings).fit(X, y)
    head0 = numpy_helper.to_array(onnx.load(path).graph.initializer[1])
    table, head = sgd_epochs(table_of(path, vocabulary), head0, X, y, 0.5, 16, 2)
    np.testing.assert_allclose(fitted.get_state()["head"], head, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fitted.get_state()["table"], table, rtol=1e-5, atol=1e-6)


def test_the_trained_model_is_saved_with_its_data_beside_it(small, tmp_path, monkeypatch):
    path, vocabulary, X, y = small
    fitted = trainer(path, ["head"]).fit(X, y)
    saved = fitted.save_trained_onnx(tmp_path / "out" / "trained.onnx")
    assert os.path.getsize(saved) < 10_000 and os.path.exists(saved + ".data")
    monkeypatch.chdir(tmp_path)  # another working directory
    expected = table_of(path, vocabulary)[X].mean(1) @ fitted.get_state()["head"]
    session = ort.InferenceSession(saved, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"X": X})[0], expected, rtol=1e-5, atol=1e-6)
    loaded = onnx.load(saved)  # onnx reads the data from the model's folder
    onnx.checker.check_model(loaded, full_check=True)
    # every graph of save_onnx_graph loads in plain onnxruntime from its folder
    for graph in fitted.save_onnx_graph(tmp_path / "graphs").values():
        ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    # the returned ModelProto is self-contained
    proto = fitted.get_trained_onnx()
    assert not any(t.data_location == TensorProto.EXTERNAL for t in proto.graph.initializer)
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got.run(None, {"X": X})[0], expected, rtol=1e-5, atol=1e-6)


def test_saving_over_the_mapped_data_file_is_refused(small):
    path, _, X, y = small
    fitted = trainer(path, ["head"]).fit(X, y)
    with pytest.raises(ValueError, match="overwrite the external data"):
        fitted.save_trained_onnx(path)


def test_a_checkpoint_references_the_frozen_base(small, tmp_path):
    path, vocabulary, X, y = small
    fitted = trainer(path, ["head"]).fit(X, y)
    fitted.save_checkpoint(tmp_path / "run.ckpt")
    assert os.path.getsize(tmp_path / "run.ckpt") < vocabulary * DIM * 4 / 10  # no table
    _, header = checkpoint.read(tmp_path / "run.ckpt")  # a reference and a digest instead
    assert header["frozen"]["table"]["file"] == "model.onnx.data"
    assert header["frozen"]["table"]["length"] == vocabulary * DIM * 4
    resumed = trainer(path, ["head"]).load_checkpoint(tmp_path / "run.ckpt")
    np.testing.assert_array_equal(resumed.get_state()["head"], fitted.get_state()["head"])
    # the same graph over other base weights: refused, the digest differs
    other = save_external(embedding_model(vocabulary, seed=5), tmp_path / "other")
    with pytest.raises(checkpoint.CheckpointError, match=r"another frozen weight .table.*differ"):
        trainer(other, ["head"]).load_checkpoint(tmp_path / "run.ckpt")


def test_a_mapped_tensor_of_the_wrong_length_is_named(small, tmp_path):
    path, vocabulary, _, _ = small
    model = onnx.load(path, load_external_data=False)
    table = model.graph.initializer[0]
    for entry in table.external_data:
        if entry.key == "length":
            entry.value = str(vocabulary * DIM * 4 - 1024)
    broken = tmp_path / "model.onnx"
    broken.write_bytes(model.SerializeToString())
    shutil.copy(path + ".data", tmp_path / "model.onnx.data")
    with pytest.raises(IncompatibleModelError, match=r"'table'.*holds 2096128 bytes"):
        load_model(str(broken))


def test_training_that_cannot_fit_is_refused_before_allocating(small, monkeypatch):
    path, vocabulary, X, y = small
    monkeypatch.setattr(memory, "available_bytes", lambda: 4 << 20)  # 4 MiB
    with pytest.raises(InsufficientMemoryError) as caught:
        trainer(path).fit(X, y)
    weights, table = (vocabulary * DIM + DIM * CLASSES) * 4, vocabulary * DIM * 4
    assert f"{(3 * weights + 3 * table) / 2**30:.1f} GiB" in str(caught.value)  # sgd
    assert "weights_to_train" in str(caught.value)
    trainer(path, ["head"]).fit(X, y)  # the head alone fits


def test_an_inline_model_past_protobufs_limit_names_the_fix(monkeypatch):
    from graphkit.engine import ort_engine

    monkeypatch.setattr(tensor_store, "PROTOBUF_LIMIT", 1000)
    with pytest.raises(IncompatibleModelError, match="pass graphkit the path"):
        ort_engine.inference_session(embedding_model(16))


def _gib_available() -> float:
    available = memory.available_bytes()
    return (available or 0) / 2**30


def _gib_free_on_disk() -> float:
    return shutil.disk_usage(tempfile.gettempdir()).free / 2**30


@pytest.mark.skipif(_gib_available() < 12, reason="the 2 GB model needs 12 GB of available memory")
@pytest.mark.skipif(
    _gib_free_on_disk() < 8, reason="the 2 GB model and its saved copy need 8 GB of free disk"
)
def test_a_model_over_two_gigabytes_fine_tunes_and_saves(tmp_path):
    # 2.2 GB of embeddings in one external file: past protobuf's 2 GiB (2^31 - 1 bytes)
    vocabulary = 2_200_000_000 // (DIM * 4)
    folder = tmp_path / "big"
    folder.mkdir()
    head = (np.random.default_rng(0).standard_normal((DIM, CLASSES)) * 0.1).astype(np.float32)
    data = folder / "model.onnx.data"
    with open(data, "wb") as handle:  # the table in chunks: never 2 GB in memory at once
        rows = 1 << 18
        for start in range(0, vocabulary, rows):
            count = min(rows, vocabulary - start)
            chunk = np.arange(start, start + count, dtype=np.float32)[:, None] * 1e-7
            handle.write((chunk + np.linspace(-1, 1, DIM, dtype=np.float32)).tobytes())
    small = embedding_model(4)
    table = small.graph.initializer[0]
    table.ClearField("raw_data")
    table.dims[:] = [vocabulary, DIM]
    table.data_location = TensorProto.EXTERNAL
    table.external_data.add(key="location", value="model.onnx.data")
    table.external_data.add(key="length", value=str(vocabulary * DIM * 4))
    small.graph.initializer[1].CopyFrom(numpy_helper.from_array(head, "head"))
    path = folder / "model.onnx"
    path.write_bytes(small.SerializeToString())
    assert os.path.getsize(data) > tensor_store.PROTOBUF_LIMIT

    rng = np.random.default_rng(2)
    X = rng.integers(0, vocabulary, size=(256, TOKENS)).astype(np.int64)
    y = rng.integers(0, CLASSES, size=256).astype(np.int64)
    fitted = trainer(str(path), ["head"], batch_size=256).fit(X, y)
    table_rows = np.memmap(data, np.float32, "r", shape=(vocabulary, DIM))
    pooled = np.asarray(table_rows[X]).mean(1)
    expected = softmax_cross_entropy_step(pooled, head, y, 0.5)
    np.testing.assert_allclose(fitted.get_state()["head"], expected, rtol=1e-5, atol=1e-7)

    saved = fitted.save_trained_onnx(tmp_path / "out" / "trained.onnx")
    session = ort.InferenceSession(saved, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(
        session.run(None, {"X": X[:4]})[0], pooled[:4] @ expected, rtol=1e-4, atol=1e-6
    )


def test_onnx_module_takes_a_mapped_model(small):
    torch = pytest.importorskip("torch")
    from graphkit_train import OnnxModule

    path, vocabulary, X, _ = small
    layer = OnnxModule(path, ["head"])
    head = next(iter(layer.parameters()))
    out = layer(torch.from_numpy(X))
    out.sum().backward()
    pooled = table_of(path, vocabulary)[X].mean(1)
    head0 = numpy_helper.to_array(onnx.load(path).graph.initializer[1])
    np.testing.assert_allclose(out.detach().numpy(), pooled @ head0, rtol=1e-5, atol=1e-6)
    # d sum(pooled @ head) / d head = pooled^T 1
    expected = pooled.T @ np.ones((len(X), CLASSES), np.float32)
    np.testing.assert_allclose(head.grad.numpy(), expected, rtol=1e-5, atol=1e-5)
