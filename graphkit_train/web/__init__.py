"""Training in a web page: a folder that onnxruntime-web's wasm backend trains.

:func:`export_web` writes a trainer's exported training step and epoch, the graphs
that score and predict with the weights as inputs, the current weights and optimizer
state, a JSON manifest and ``graphkit-web.mjs``, the ES module that runs them in a
browser with onnxruntime-web (no server does any of the work)::

    from graphkit_train.web import export_web
    export_web(trainer, "site/model")          # or: graphkit-train export --web DIR

    // in the page
    import { loadTrainer } from "./model/graphkit-web.mjs";
    const trainer = await loadTrainer("./model/", { ort });
    await trainer.fit(X, y, { epochs: 10, onEpoch: (e, losses) => ... });
    const bytes = trainer.exportModel();       // the trained model, ONNX bytes
"""

from graphkit_train.web.export import MANIFEST, MODULE, export_web

__all__ = ["MANIFEST", "MODULE", "export_web"]
