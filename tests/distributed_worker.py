"""Run by tests/test_distributed.py under torchrun (2 ranks): each scenario writes what
every rank ended with into the output folder, for the test to compare."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer, distributed

PER_RANK_BATCH = 8


def mlp(seed: int = 0) -> object:
    """Y = tanh(X W1 + b1) W2 + b2, float64, 3 -> 4 -> 1."""
    rng = np.random.default_rng(seed)
    init = {
        "W1": rng.normal(size=(3, 4)),
        "b1": np.zeros(4),
        "W2": rng.normal(size=(4, 1)),
        "b2": np.zeros(1),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["X", "W1", "b1"], ["h"]),
            helper.make_node("Tanh", ["h"], ["t"]),
            helper.make_node("Gemm", ["t", "W2", "b2"], ["Y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.DOUBLE, ["N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, ["N", 1])],
        [numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(96, 3))
    return X, np.sin(X).sum(axis=1), rng.uniform(0.1, 2.0, size=96)


def trainer(mode: str, optimizer: str, weighted: bool, distributed_: bool, batch: int):
    settings = dict(
        max_iter=2,
        batch_size=batch,
        random_state=0,
        learning_rate=(gk.optimizers.get(optimizer), 0.05),
        validation_every=1,
        distributed=distributed_,
    )
    if mode == "full":
        graph = gk.add_loss_output(mlp(), weight_name="weight" if weighted else None)
        return OrtGradientOptimizer(graph, **settings)
    return OrtGradientForwardBackwardOptimizer(mlp(), **settings)


COMBOS = [
    ("full", "sgd", False),
    ("full", "adam", True),
    ("forward_backward", "sgd", True),
    ("forward_backward", "adam", False),
]


def equivalence(out: Path, rank: int) -> None:
    X, y, w = data()
    for mode, optimizer, weighted in COMBOS:
        model = trainer(mode, optimizer, weighted, True, PER_RANK_BATCH)
        model.fit(X, y, w if weighted else None, X_val=X[:30], y_val=y[:30])
        np.savez(
            out / f"{mode}-{optimizer}-{weighted}-rank{rank}.npz",
            train=model.train_losses_,
            validation=model.validation_losses_,
            **{k: v for k, v in model.get_state().items()},
        )


def errors(out: Path, rank: int) -> None:
    X, y, _ = data()
    messages = {}
    bad = y.copy()
    if rank == 1:
        bad[3] = np.nan
    cases = {
        "bad_input_on_rank_1": lambda: trainer("full", "sgd", False, True, 8).fit(X, bad),
        "different_models": lambda: OrtGradientForwardBackwardOptimizer(
            mlp(seed=rank), distributed=True
        ).fit(X, y),
        "more_ranks_than_rows": lambda: trainer("full", "sgd", False, True, 8).fit(X[:1], y[:1]),
        # rank 1's targets overflow the squared error: the all-reduced loss is infinite
        "overflow_on_rank_1": lambda: trainer("forward_backward", "sgd", False, True, 8).fit(
            X, y * (1e200 if rank == 1 else 1.0)
        ),
    }
    for name, case in cases.items():
        try:
            case()
            messages[name] = None
        except Exception as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
    (out / f"errors-rank{rank}.json").write_text(json.dumps(messages))


def timeout(out: Path, rank: int) -> None:
    """Rank 1 fails in the middle of training (after its first epoch): rank 0, waiting
    in the next collective, fails when the process group's timeout expires."""

    def fail_on_rank_1(epoch, losses, model):
        if rank == 1:
            raise RuntimeError("rank 1 lost its data")

    X, y, _ = data()
    start = time.perf_counter()
    try:
        trainer("full", "sgd", False, True, 8).fit(X, y, callback=fail_on_rank_1)
        message = None
    except Exception as exc:
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    seconds = time.perf_counter() - start
    (out / f"timeout-rank{rank}.json").write_text(json.dumps([message, seconds]))
    if rank == 1:
        time.sleep(8)  # alive but silent: rank 0 must give up on its own, by the timeout
    os._exit(0)  # the group is broken: leave without the barrier of shutdown()


def ddp(out: Path, rank: int) -> None:
    """OnnxModule inside DistributedDataParallel: one SGD step on each rank's half."""
    import torch

    from graphkit_train.torch_module import OnnxModule

    X, y, _ = data()
    net = torch.nn.parallel.DistributedDataParallel(OnnxModule(mlp()))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    rows = slice(rank * 16, (rank + 1) * 16)
    loss = torch.mean((net(torch.from_numpy(X[rows]))[:, 0] - torch.from_numpy(y[rows])) ** 2)
    loss.backward()
    optimizer.step()
    np.savez(
        out / f"ddp-rank{rank}.npz",
        **{n: p.detach().numpy() for n, p in net.module.named_parameters()},
    )
    # DDP's reducer holds the process group: release it before the group is destroyed
    torch.distributed.barrier()
    del net, optimizer, loss
    gc.collect()


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    group = distributed.init(timeout_seconds=5 if scenario == "timeout" else 60)
    scenarios = {"equivalence": equivalence, "errors": errors, "ddp": ddp, "timeout": timeout}
    scenarios[scenario](out, group.rank)
    distributed.shutdown()


if __name__ == "__main__":
    main()
