"""compile_function's cache is keyed by what a function computes, not by the function
object: factories build a fresh onnxscript closure per call, so a cache keyed by the
object never hit, and held every closure and model it was given (memory grew with every
``fit``). Equal content shares one entry; different hyper-parameters never do."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphkit import _graph, optimizers
from graphkit._graph import COMPILED, CompiledModels, function_digest
from graphkit.transforms import WeightInfo, apply_updates

WEIGHTS = {"w": WeightInfo(np.dtype(np.float64), (3, 2))}


def scripted(tx):
    """The onnxscript functions of a chain, in order."""
    return [t.update_fn for t in tx._walk() if hasattr(t, "update_fn")]


@pytest.fixture
def empty_cache():
    COMPILED.clear()
    yield COMPILED
    COMPILED.clear()


def test_fresh_factories_share_one_entry_per_distinct_content(empty_cache):
    optimizers.adam(learning_rate=0.01).model(WEIGHTS)
    entries = len(empty_cache)
    assert entries >= 2  # Adam's rule and the learning rate, at least
    for _ in range(20):
        optimizers.adam(learning_rate=0.01).model(WEIGHTS)
    assert len(empty_cache) == entries
    assert empty_cache.hits >= 20 * entries

    # one hyper-parameter changed: only Adam's rule is new (the rate's function is equal)
    optimizers.adam(learning_rate=0.01, b1=0.8).model(WEIGHTS)
    assert len(empty_cache) == entries + 1
    # another dtype or shape is another model
    optimizers.adam(learning_rate=0.01).model({"w": WeightInfo(np.dtype(np.float32), (3, 2))})
    assert len(empty_cache) > entries + 1


def test_the_digest_sees_constants_in_the_functions_called():
    """Adam's b1 sits in the function its rule calls, which ``to_function_proto`` leaves
    out: a key made from it alone would give b1 = 0.8 the model of b1 = 0.9."""
    (a, _), (b, _), (c, _) = (
        scripted(optimizers.adam(b1=0.9)),
        scripted(optimizers.adam(b1=0.9)),
        scripted(optimizers.adam(b1=0.8)),
    )
    assert a is not b
    assert function_digest(a) == function_digest(b)
    assert a.to_function_proto() == c.to_function_proto()  # the trap
    assert function_digest(a) != function_digest(c)
    for name in ("momentum", "rmsprop", "lion"):  # constants in the function's own body
        factory = getattr(optimizers, name)
        first, second = scripted(factory()), scripted(factory())
        assert [function_digest(f) for f in first] == [function_digest(f) for f in second]


@pytest.mark.parametrize("b1", [0.9, 0.5])
def test_different_hyper_parameters_compile_to_different_models(b1, empty_cache, rng):
    """Built one after the other from the shared cache, adam(b1=0.9) and adam(b1=0.5) each
    follow torch.optim.Adam with their own betas, and differ from each other."""
    torch = pytest.importorskip("torch")
    w0 = rng.normal(size=(3, 2))
    grads = [rng.normal(size=w0.shape) for _ in range(5)]
    results = {}
    for beta in (0.9, 0.5, b1):  # b1 last: built again, from the cache
        opt = optimizers.adam(learning_rate=0.01, b1=beta)
        params = {"w": w0}
        state = opt.init(params)
        for step, g in enumerate(grads):
            updates, state = opt.update({"w": g}, state, params, step)
            params = apply_updates(params, updates)
        results[beta] = params["w"]
    t = torch.tensor(w0.copy(), requires_grad=True)
    reference = torch.optim.Adam([t], lr=0.01, betas=(b1, 0.999))
    for g in grads:
        t.grad = torch.tensor(g)
        reference.step()
    np.testing.assert_allclose(results[b1], t.detach().numpy(), rtol=1e-12)
    assert np.abs(results[0.9] - results[0.5]).max() > 1e-4


def test_the_cache_holds_no_function_object(empty_cache):
    opt = optimizers.adam(learning_rate=0.01)
    opt.model(WEIGHTS)
    refs = [weakref.ref(f) for f in scripted(opt)]
    del opt
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(empty_cache) > 0


def test_the_cache_is_bounded_in_entries_and_bytes():
    cache = CompiledModels(max_entries=3, max_bytes=100)
    for i in range(5):
        cache.put(i, bytes(10))
    assert len(cache) == 3 and cache.get(0) is None and cache.get(4) == bytes(10)
    cache.get(2)  # used: the least recently used is now 3
    cache.put(5, bytes(10))
    assert cache.get(3) is None and cache.get(2) is not None
    cache.put("big", bytes(95))  # 100 bytes at most: only the newest fits
    assert cache.nbytes <= 100 and cache.get("big") is not None and len(cache) == 1
    cache.put("huge", bytes(500))  # larger than the bound: not kept
    assert len(cache) == 0 and cache.nbytes == 0
    assert COMPILED.max_entries <= 1024 and COMPILED.max_bytes <= 64 * 2**20


def _linear_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["Y"])],
        "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])],
        [
            numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), "W"),
            numpy_helper.from_array(np.zeros(3, np.float32), "b"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_repeated_fits_add_no_entries(empty_cache, rng):
    """Each fit of a new trainer with a new optimizer builds the same functions again:
    after the first, the cache neither grows nor compiles anything (it grew by 8 entries,
    about 0.7 MB of RSS, a fit)."""
    from graphkit_train.trainers.full import Trainer

    X = rng.normal(size=(32, 4)).astype(np.float32)
    y = rng.normal(size=(32, 3)).astype(np.float32)

    def fit() -> None:
        trainer = Trainer(
            _linear_model(),
            loss="squared_error",
            max_iter=1,
            batch_size=16,
            optimizer=optimizers.adam(learning_rate=0.01),
        )
        trainer.fit(X, y)

    fit()
    entries, misses = len(empty_cache), empty_cache.misses
    for _ in range(5):
        fit()
    assert len(empty_cache) == entries
    assert empty_cache.misses == misses
    assert _graph.COMPILED is empty_cache
