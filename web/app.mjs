// The demo page: train the exported folder named by ?model= (default: demo/, written by
// `make web`) on the rows it ships (data.json), draw the losses, offer the trained model.
//
// Query parameters: model (folder URL), threads (wasm threads, default 1), epochs (default
// 100).
// Tests drive the page through window.demo: { ready, trainer, train(options), last, error }.
import * as ort from "./node_modules/onnxruntime-web/dist/ort.wasm.min.mjs";

const params = new URLSearchParams(location.search);
const folder = new URL(params.get("model") ?? "demo/", location.href);
// one thread by default: a second one needs a cross-origin isolated page, and did not pay
// off on the models of benchmarks/results/web.md
const threads = Number(params.get("threads") ?? 1);
ort.env.wasm.wasmPaths = new URL("./node_modules/onnxruntime-web/dist/", import.meta.url).href;
ort.env.wasm.numThreads = threads;

const $ = (id) => document.getElementById(id);
const demo = { trainer: null, error: null, threads };
window.demo = demo;

function showError(error) {
  demo.error = String(error?.message ?? error);
  $("error").textContent = demo.error;
  $("error").classList.add("shown");
  $("status").textContent = "Stopped: see the error below.";
  console.error(`graphkit-web: ${demo.error}`);
}

function status(text) {
  $("status").textContent = text;
}

demo.ready = (async () => {
  try {
    const { loadTrainer } = await import(new URL("graphkit-web.mjs", folder).href);
    const trainer = await loadTrainer(folder, { ort });
    demo.trainer = trainer;
    if (!trainer.data) throw new Error(`${folder}data.json is missing: this folder ships no rows to train on.`);
    $("batch").value = trainer.batchSize;
    $("epochs").value = params.get("epochs") ?? $("epochs").value;
    $("train").disabled = false;
    const rows = trainer.data.train.y.length;
    const held = trainer.data.held_out?.y.length ?? 0;
    status(`Ready: ${rows} training rows, ${held} held out; onnxruntime-web ${ort.env.versions?.web ?? ""}, ${threads} thread(s).`);
    facts(trainer);
    return true;
  } catch (error) {
    showError(error);
    return false;
  }
})();

/** Train with the form's settings (or `options`); errors are shown, never thrown. */
demo.train = async (options = {}) => {
  const trainer = demo.trainer;
  const data = trainer.data;
  const epochs = options.epochs ?? Number($("epochs").value);
  const batchSize = options.batchSize ?? Number($("batch").value);
  const seed = options.seed ?? Number($("seed").value);
  $("train").disabled = true;
  $("error").classList.remove("shown");
  demo.error = null;
  const start = performance.now();
  try {
    await trainer.fit(data.train.X, data.train.y, {
      epochs,
      batchSize,
      seed,
      validation: data.held_out ?? null,
      ...options,
      onEpoch: (epoch, losses) => {
        status(`Epoch ${trainer.trainLosses.length}: training loss ${losses.train.toPrecision(5)}` +
          (losses.heldOut === null ? "" : `, held-out loss ${losses.heldOut.toPrecision(5)}`));
        draw(trainer);
      },
    });
    const seconds = (performance.now() - start) / 1000;
    status(`Trained ${epochs} epochs in ${seconds.toFixed(2)} s (${threads} thread(s)).`);
    await facts(trainer);
    $("download").disabled = false;
    return { ok: true, seconds };
  } catch (error) {
    showError(error);
    return { ok: false, error: demo.error };
  } finally {
    $("train").disabled = false;
  }
};

$("train").addEventListener("click", () => {
  demo.last = demo.train(); // what the button started, for a test to await
});
$("download").addEventListener("click", () => {
  const blob = new Blob([demo.trainer.exportModel()], { type: "application/octet-stream" });
  const link = Object.assign(document.createElement("a"), {
    href: URL.createObjectURL(blob),
    download: "model.trained.onnx",
  });
  link.click();
  URL.revokeObjectURL(link.href);
});

async function facts(trainer) {
  const rows = [
    ["model", folder.pathname],
    ["loss", `${trainer.manifest.loss.name} (${trainer.manifest.loss.reduction})`],
    ["optimizer", trainer.manifest.optimizer.name],
    ["weights", trainer.manifest.weights.join(", ")],
  ];
  const held = trainer.data?.held_out;
  if (held && trainer.trainLosses.length) {
    const predicted = await trainer.predict(held.X);
    if (trainer.manifest.prediction.kind === "labels") {
      const right = predicted.filter((p, i) => p === held.y[i]).length;
      rows.push(["held-out accuracy", (right / held.y.length).toFixed(4)]);
    } else if (held.y.every((v) => typeof v === "number")) {
      const mean = held.y.reduce((a, b) => a + b, 0) / held.y.length;
      const residual = held.y.reduce((a, v, i) => a + (v - predicted[i]) ** 2, 0);
      const total = held.y.reduce((a, v) => a + (v - mean) ** 2, 0);
      rows.push(["held-out R²", (1 - residual / total).toFixed(4)]);
    }
  }
  $("facts").replaceChildren(
    ...rows.map(([k, v]) => {
      const tr = document.createElement("tr");
      tr.append(Object.assign(document.createElement("td"), { textContent: k }));
      tr.append(Object.assign(document.createElement("td"), { textContent: v }));
      return tr;
    }),
  );
}

/** The training and held-out loss per epoch, log scale. */
function draw(trainer) {
  const canvas = $("chart");
  const g = canvas.getContext("2d");
  const [w, h] = [canvas.width, canvas.height];
  const pad = { left: 64, right: 16, top: 16, bottom: 36 };
  g.clearRect(0, 0, w, h);
  const series = [
    { name: "training loss", values: trainer.trainLosses, color: "#1f6feb" },
    { name: "held-out loss", values: trainer.heldOutLosses, color: "#e36209" },
  ].filter((s) => s.values.length);
  const all = series.flatMap((s) => s.values).filter((v) => v > 0);
  if (!all.length) return;
  const lo = Math.log10(Math.min(...all));
  const hi = Math.log10(Math.max(...all)) + 1e-9;
  const epochs = Math.max(...series.map((s) => s.values.length));
  const x = (i) => pad.left + ((w - pad.left - pad.right) * i) / Math.max(1, epochs - 1);
  const y = (v) => pad.top + ((h - pad.top - pad.bottom) * (hi - Math.log10(v))) / Math.max(1e-9, hi - lo);
  g.strokeStyle = "#ccc";
  g.fillStyle = "#555";
  g.font = "12px system-ui, sans-serif";
  g.beginPath();
  g.moveTo(pad.left, pad.top);
  g.lineTo(pad.left, h - pad.bottom);
  g.lineTo(w - pad.right, h - pad.bottom);
  g.stroke();
  for (let k = 0; k <= 4; k++) {
    const v = 10 ** (lo + ((hi - lo) * k) / 4);
    g.fillText(v.toPrecision(3), 4, y(v) + 4);
  }
  g.fillText("epoch", w / 2, h - 8);
  g.fillText("1", x(0) - 3, h - pad.bottom + 16);
  g.fillText(String(epochs), x(epochs - 1) - 10, h - pad.bottom + 16);
  series.forEach((s, index) => {
    g.strokeStyle = s.color;
    g.lineWidth = 2;
    g.beginPath();
    s.values.forEach((v, i) => (i ? g.lineTo(x(i), y(v)) : g.moveTo(x(i), y(v))));
    g.stroke();
    g.fillStyle = s.color;
    g.fillText(s.name, w - pad.right - 110, pad.top + 14 + 16 * index);
  });
}
