// graphkit-web: train a graphkit export in a web page with onnxruntime-web.
//
// onnxruntime-web has no training API since onnxruntime 1.20; graphkit's exports hold
// standard ONNX only, so its inference engine trains them: a loop feeds a batch and the
// resident tensors (weights, optimizer state, step, loss_sum) to the exported step and
// feeds each output '<name>.next' back, as graphkit's PortableTrainer does in Python.
//
//   import * as ort from "onnxruntime-web";
//   import { loadTrainer } from "./model/graphkit-web.mjs";
//   const trainer = await loadTrainer("./model/", { ort });
//   await trainer.fit(X, y, { epochs: 10, onEpoch: (epoch, losses) => draw(losses) });
//   trainer.predict(Xnew);            // values, or class labels 0..K-1
//   trainer.exportModel();            // the trained model: ONNX bytes (Uint8Array)
//
// X is an array of rows (each row an array, nested as the input's dims after the first:
// [1, 8, 8] rows may be 8 arrays of 8 numbers), or { input name: rows } for a model with
// several inputs. y is an array of labels: numbers, or rows of numbers for k targets.
// Every error is a GraphkitWebError whose message names the problem and the fix.

export const FORMAT = "graphkit-web";
export const VERSION = 1;

/** A problem with the folder, the data or the runtime, explained. */
export class GraphkitWebError extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = "GraphkitWebError";
  }
}

const ARRAYS = {
  float32: Float32Array,
  float64: Float64Array,
  int64: BigInt64Array,
  int32: Int32Array,
  uint8: Uint8Array,
  int8: Int8Array,
  bool: Uint8Array,
};
const ONNX_TYPES = { float32: 1, uint8: 2, int8: 3, int32: 6, int64: 7, bool: 9, float64: 11 };

/**
 * Load an exported folder: its manifest, graphs and state, each checked.
 *
 * @param {string|URL} base  the folder's URL (ends with "/").
 * @param {object} options
 *   ort: the onnxruntime-web module (default: globalThis.ort);
 *   executionProviders: default ["wasm"];
 *   fetch: default globalThis.fetch.
 * @returns {Promise<WebTrainer>}
 */
export async function loadTrainer(base, options = {}) {
  const ort = options.ort ?? globalThis.ort;
  if (!ort || typeof ort.InferenceSession?.create !== "function") {
    throw new GraphkitWebError(
      "loadTrainer needs onnxruntime-web: pass { ort } (import * as ort from " +
        "'onnxruntime-web') or load it as the global 'ort' first.",
    );
  }
  const get = options.fetch ?? globalThis.fetch.bind(globalThis);
  const folder = new URL(base, globalThis.location?.href ?? "file:///");
  const manifest = await fetchJson(get, new URL("manifest.json", folder));
  checkManifest(manifest);
  const blobs = {};
  for (const [key, file] of Object.entries(manifest.files)) {
    blobs[key] = await fetchBytes(get, new URL(file.path, folder));
  }
  await checkDigests(manifest, blobs);
  const sessionOptions = {
    executionProviders: options.executionProviders ?? ["wasm"],
    graphOptimizationLevel: "all",
  };
  const sessions = {};
  for (const key of ["step", "epoch", "evaluate", "predict"]) {
    const file = manifest.files[key].path;
    try {
      sessions[key] = await ort.InferenceSession.create(blobs[key], sessionOptions);
    } catch (error) {
      throw new GraphkitWebError(
        `onnxruntime-web (${sessionOptions.executionProviders.join(", ")}) cannot load ` +
          `${file}: ${error?.message ?? error}. Its operators: ` +
          `${(manifest.operators?.[key] ?? []).join(", ") || "see the file"}. An operator ` +
          "onnxruntime-web lacks cannot train in the browser: train this model in Python, " +
          "or replace that operator in the model.",
        { cause: error },
      );
    }
    checkSession(manifest, key, sessions[key]);
  }
  const data = manifest.data ? await fetchJson(get, new URL(manifest.data, folder)) : null;
  return new WebTrainer(ort, manifest, sessions, blobs, data);
}

/** Mini-batch training of an exported model, in the page. */
export class WebTrainer {
  constructor(ort, manifest, sessions, blobs, data) {
    this.ort = ort;
    this.manifest = manifest;
    this.sessions = sessions;
    this.template = blobs.template;
    this.data = data; // data.json when the export shipped rows, else null
    this.state = unpackState(ort, manifest, blobs.state);
    this.trainLosses = [];
    this.heldOutLosses = [];
    this.busy = false;
  }

  /** The number of rows a batch takes by default (the trainer's batch_size). */
  get batchSize() {
    return this.manifest.batch_size;
  }

  /**
   * Train epochs more epochs. Each epoch's mean batch loss is appended to trainLosses,
   * and the held-out loss to heldOutLosses when `validation` is given.
   *
   * options: epochs (1), batchSize (the export's), shuffle (true: a new permutation per
   * epoch from `seed`), seed (0), order (permutations to use instead: an array, one per
   * epoch, or a function (epoch, rows) => permutation), sampleWeight (one per row),
   * validation ({ X, y }), onEpoch ((epoch, { train, heldOut }, trainer) => ..., awaited;
   * returning true stops), mode ("epoch": one run per epoch, the default; "step": one
   * run per batch, as Python's PortableTrainer).
   *
   * A failed run leaves the weights and optimizer state as they were before it.
   */
  async fit(X, y, options = {}) {
    const {
      epochs = 1,
      batchSize = this.manifest.batch_size,
      shuffle = true,
      seed = 0,
      order = null,
      sampleWeight = null,
      validation = null,
      onEpoch = null,
      mode = "epoch",
    } = options;
    positiveInteger(epochs, "epochs", true);
    positiveInteger(batchSize, "batchSize");
    if (mode !== "epoch" && mode !== "step") {
      throw new GraphkitWebError(`mode must be "epoch" or "step", got ${JSON.stringify(mode)}.`);
    }
    const data = this.tables(X, y, sampleWeight, "");
    const held = validation ? this.tables(validation.X, validation.y, null, "validation.") : null;
    const random = mulberry32(seed >>> 0);
    this.guard(true);
    try {
      for (let epoch = 0; epoch < epochs; epoch++) {
        const permutation = epochOrder(order, shuffle, epoch, data.rows, random);
        const train =
          mode === "epoch"
            ? await this.runEpoch(data, permutation, batchSize)
            : await this.runSteps(data, permutation, batchSize);
        if (!Number.isFinite(train)) {
          throw new GraphkitWebError(
            `The loss became ${train} during epoch ${this.trainLosses.length + 1}; the ` +
              "weights and optimizer state are those before that epoch. Lower the learning rate.",
          );
        }
        this.trainLosses.push(train);
        let heldOut = null;
        if (held) {
          heldOut = await this.lossOf(held);
          this.heldOutLosses.push(heldOut);
        }
        const stop = onEpoch ? await onEpoch(this.trainLosses.length, { train, heldOut }, this) : false;
        await new Promise((resolve) => setTimeout(resolve, 0)); // let the page draw
        if (stop === true) break;
      }
    } finally {
      this.guard(false);
    }
    return this;
  }

  /** The loss on (X, y) with the current weights. */
  async evaluate(X, y, sampleWeight = null) {
    return this.lossOf(this.tables(X, y, sampleWeight, ""));
  }

  /**
   * Predictions with the current weights: the output's values (a number per row for one
   * column, else a row of numbers) or, for a classifier, class labels 0..K-1.
   */
  async predict(X) {
    const rows = this.features(X, "");
    const feeds = { ...rows.tensors, ...this.weightFeeds() };
    const output = (await this.run("predict", feeds))[this.manifest.prediction.output];
    return predictions(output, this.manifest.prediction);
  }

  /** The trained model as ONNX bytes: the template plus the current weights. */
  exportModel() {
    const tensors = this.manifest.weights.map((name) => encodeTensor(name, this.state[name]));
    const graph = concat(tensors.map((t) => field(5, t)));
    const tail = field(7, graph); // ModelProto.graph: merged into the template's graph
    return concat([this.template, tail]);
  }

  /** The current weights and optimizer state: { name: { type, dims, data } }. */
  getState() {
    const out = {};
    for (const [name, tensor] of Object.entries(this.state)) {
      out[name] = { type: tensor.type, dims: [...tensor.dims], data: tensor.data.slice() };
    }
    return out;
  }

  // -- running the graphs ------------------------------------------------------------

  async runEpoch(data, permutation, batchSize) {
    const { ort } = this;
    const feeds = { ...data.tensors, ...this.state };
    feeds.loss_sum = zerosLike(ort, this.state.loss_sum);
    feeds.permutation = new ort.Tensor("int64", BigInt64Array.from(permutation, BigInt), [
      permutation.length,
    ]);
    feeds.batch_size = new ort.Tensor("int64", BigInt64Array.of(BigInt(batchSize)), []);
    const out = await this.run("epoch", feeds);
    const losses = out.batch_losses.data;
    let total = 0;
    for (const loss of losses) total += Number(loss);
    const mean = total / losses.length;
    if (Number.isFinite(mean)) this.keep(out);
    return mean;
  }

  async runSteps(data, permutation, batchSize) {
    const { ort } = this;
    let state = { ...this.state, loss_sum: zerosLike(ort, this.state.loss_sum) };
    let batches = 0;
    for (let start = 0; start < permutation.length; start += batchSize) {
      const rows = permutation.slice(start, start + batchSize);
      const feeds = { ...gather(ort, data.tensors, rows), ...state };
      const out = await this.run("step", feeds);
      state = {};
      for (const name of Object.keys(this.state)) state[name] = out[`${name}.next`];
      batches += 1;
    }
    const mean = Number(state.loss_sum.data[0]) / batches;
    if (Number.isFinite(mean)) this.state = state;
    return mean;
  }

  async lossOf(tables) {
    const feeds = { ...tables.tensors, ...this.weightFeeds() };
    const out = await this.run("evaluate", feeds);
    return Number(out[this.manifest.loss.output].data[0]);
  }

  async run(key, feeds) {
    const session = this.sessions[key];
    const wanted = {};
    for (const name of session.inputNames) {
      if (!(name in feeds)) {
        throw new GraphkitWebError(`graphkit-web bug: no value for input ${name} of ${key}.`);
      }
      wanted[name] = feeds[name];
    }
    try {
      return await session.run(wanted);
    } catch (error) {
      throw new GraphkitWebError(
        `onnxruntime-web failed running ${this.manifest.files[key].path}: ` +
          `${error?.message ?? error}. The weights are those before this run.`,
        { cause: error },
      );
    }
  }

  keep(out) {
    const next = {};
    for (const name of Object.keys(this.state)) next[name] = out[`${name}.next`];
    this.state = next;
  }

  weightFeeds() {
    const feeds = {};
    for (const name of this.manifest.weights) feeds[name] = this.state[name];
    return feeds;
  }

  guard(entering) {
    if (entering && this.busy) {
      throw new GraphkitWebError("fit is already running: await it before calling fit again.");
    }
    this.busy = entering;
  }

  // -- checking and converting the data ----------------------------------------------

  features(X, prefix) {
    const inputs = this.manifest.inputs;
    let named = X;
    if (inputs.length === 1 && !isNamed(X, inputs)) named = { [inputs[0].name]: X };
    if (!named || typeof named !== "object" || Array.isArray(named)) {
      throw new GraphkitWebError(
        `${prefix}X must be { input name: rows } for this model's ${inputs.length} inputs ` +
          `(${inputs.map((i) => i.name).join(", ")}).`,
      );
    }
    const given = Object.keys(named).sort();
    const expected = inputs.map((i) => i.name).sort();
    if (given.join("\n") !== expected.join("\n")) {
      throw new GraphkitWebError(
        `${prefix}X names inputs [${given.join(", ")}]; the model's inputs are ` +
          `[${expected.join(", ")}].`,
      );
    }
    const tensors = {};
    let rows = null;
    for (const spec of inputs) {
      const where = inputs.length === 1 ? `${prefix}X` : `${prefix}X.${spec.name}`;
      tensors[spec.name] = this.table(named[spec.name], spec, where, "input");
      const n = tensors[spec.name].dims[0];
      if (rows !== null && n !== rows) {
        throw new GraphkitWebError(`${where} has ${n} rows; the other inputs have ${rows}.`);
      }
      rows = n;
    }
    return { tensors, rows };
  }

  tables(X, y, sampleWeight, prefix) {
    const { tensors, rows } = this.features(X, prefix);
    const label = this.manifest.label;
    if (!Array.isArray(y) && !ArrayBuffer.isView(y)) {
      throw new GraphkitWebError(`${prefix}y must be an array of labels, one per row of X.`);
    }
    if (y.length !== rows) {
      throw new GraphkitWebError(`${prefix}X has ${rows} rows but ${prefix}y has ${y.length}.`);
    }
    tensors[label.name] = this.table(y, label, `${prefix}y`, "label");
    if (label.classes !== null && label.classes !== undefined) {
      checkClasses(tensors[label.name].data, label.classes, `${prefix}y`);
    }
    const weight = this.manifest.sample_weight;
    if (sampleWeight !== null && sampleWeight !== undefined) {
      if (!weight) {
        throw new GraphkitWebError(
          "This model was exported without sample weights: export it from a trainer fitted " +
            "with sample_weight, or leave sampleWeight out.",
        );
      }
      if (sampleWeight.length !== rows) {
        throw new GraphkitWebError(
          `sampleWeight has ${sampleWeight.length} values; X has ${rows} rows.`,
        );
      }
    }
    if (weight) {
      const values = sampleWeight ?? new Array(rows).fill(1);
      tensors[weight.name] = this.table(Array.from(values), weight, "sampleWeight", "weight");
    }
    return { tensors, rows };
  }

  table(values, spec, where, role) {
    if (!Array.isArray(values) && !ArrayBuffer.isView(values)) {
      throw new GraphkitWebError(`${where} must be an array of rows.`);
    }
    const rows = values.length;
    if (rows === 0) throw new GraphkitWebError(`${where} has no rows.`);
    const rowDims = spec.dims.slice(1);
    const width = rowDims.reduce((a, d) => a * (d ?? NaN), 1);
    if (!Number.isFinite(width)) {
      throw new GraphkitWebError(
        `${where}: the model's ${role} ${spec.name} has dims [${spec.dims}] with unknown ` +
          "sizes after the first; graphkit-web needs them fixed (export with static shapes).",
      );
    }
    const Type = ARRAYS[spec.type];
    const data = new Type(rows * width);
    const integer = spec.type === "int64" || spec.type === "int32";
    for (let r = 0; r < rows; r++) {
      const flat = flatten(values[r]);
      if (flat.length !== width) {
        throw new GraphkitWebError(
          `${where} row ${r} has ${flat.length} values; the model's ${role} ${spec.name} ` +
            `takes ${width} per row (dims [${spec.dims.map((d) => d ?? "N")}]).`,
        );
      }
      for (let j = 0; j < width; j++) {
        const v = Number(flat[j]);
        if (!Number.isFinite(v) || (integer && !Number.isInteger(v))) {
          const what = integer ? "an integer" : "a finite number";
          throw new GraphkitWebError(
            `${where} row ${r} holds ${flat[j]} at position ${j}, not ${what}.`,
          );
        }
        data[r * width + j] = spec.type === "int64" ? BigInt(v) : v;
      }
    }
    return new this.ort.Tensor(spec.type, data, [rows, ...rowDims]);
  }
}

// -- helpers ---------------------------------------------------------------------------

async function fetchBytes(get, url) {
  let response;
  try {
    response = await get(url);
  } catch (error) {
    throw new GraphkitWebError(`Cannot fetch ${url}: ${error?.message ?? error}.`, {
      cause: error,
    });
  }
  if (!response.ok) {
    throw new GraphkitWebError(
      `Cannot fetch ${url}: HTTP ${response.status}. Serve the whole exported folder.`,
    );
  }
  return new Uint8Array(await response.arrayBuffer());
}

async function fetchJson(get, url) {
  const bytes = await fetchBytes(get, url);
  try {
    return JSON.parse(new TextDecoder().decode(bytes));
  } catch (error) {
    throw new GraphkitWebError(`${url} is not JSON: ${error.message}.`, { cause: error });
  }
}

function checkManifest(manifest) {
  if (manifest?.format !== FORMAT) {
    throw new GraphkitWebError(
      "manifest.json is not a graphkit-web manifest: write the folder with " +
        "graphkit-train export --web DIR (or graphkit_train.web.export_web).",
    );
  }
  if (manifest.version !== VERSION) {
    throw new GraphkitWebError(
      `manifest.json has version ${manifest.version}; this graphkit-web.mjs reads ` +
        `version ${VERSION}. Use the graphkit-web.mjs written with the folder.`,
    );
  }
}

async function checkDigests(manifest, blobs) {
  const subtle = globalThis.crypto?.subtle;
  for (const [key, file] of Object.entries(manifest.files)) {
    const bytes = blobs[key];
    if (subtle) {
      const digest = hex(new Uint8Array(await subtle.digest("SHA-256", bytes)));
      if (digest !== file.sha256) {
        throw new GraphkitWebError(
          `manifest.json does not describe ${file.path} (its SHA-256 is ${digest.slice(0, 12)}..., ` +
            `the manifest says ${file.sha256.slice(0, 12)}...): the manifest and the graphs ` +
            "come from different exports. Export the folder again and copy all its files.",
        );
      }
    }
  }
  const size = manifest.state.reduce((end, e) => Math.max(end, e.offset + e.bytes), 0);
  if (blobs.state.byteLength !== size) {
    throw new GraphkitWebError(
      `state.bin holds ${blobs.state.byteLength} bytes; manifest.json describes ${size}: ` +
        "they come from different exports. Export the folder again.",
    );
  }
}

function checkSession(manifest, key, session) {
  const names = new Set(session.inputNames);
  const needed = [...manifest.inputs.map((i) => i.name)];
  if (key !== "predict") needed.push(manifest.label.name);
  if (key === "step" || key === "epoch") needed.push(...manifest.state.map((e) => e.name));
  else needed.push(...manifest.weights);
  const missing = needed.filter((n) => !names.has(n));
  if (missing.length) {
    throw new GraphkitWebError(
      `manifest.json does not describe ${manifest.files[key].path}: it has no inputs ` +
        `[${missing.join(", ")}]. The manifest comes from another export; export the folder again.`,
    );
  }
}

function unpackState(ort, manifest, bytes) {
  const state = {};
  for (const entry of manifest.state) {
    const Type = ARRAYS[entry.type];
    const count = entry.bytes / Type.BYTES_PER_ELEMENT;
    // a copy: the tensor owns its memory, aligned whatever the buffer's offset
    const copy = bytes.slice(entry.offset, entry.offset + entry.bytes);
    state[entry.name] = new ort.Tensor(entry.type, new Type(copy.buffer, 0, count), entry.dims);
  }
  return state;
}

function zerosLike(ort, tensor) {
  return new ort.Tensor(tensor.type, new ARRAYS[tensor.type](tensor.data.length), tensor.dims);
}

function gather(ort, tensors, rows) {
  const out = {};
  for (const [name, tensor] of Object.entries(tensors)) {
    const width = tensor.data.length / tensor.dims[0];
    const data = new tensor.data.constructor(rows.length * width);
    rows.forEach((row, i) => data.set(tensor.data.subarray(row * width, (row + 1) * width), i * width));
    out[name] = new ort.Tensor(tensor.type, data, [rows.length, ...tensor.dims.slice(1)]);
  }
  return out;
}

function epochOrder(order, shuffle, epoch, rows, random) {
  let permutation;
  if (typeof order === "function") permutation = order(epoch, rows);
  else if (order) {
    if (!order[epoch]) {
      throw new GraphkitWebError(`order has ${order.length} permutations; epoch ${epoch + 1} needs one.`);
    }
    permutation = order[epoch];
  } else if (shuffle) {
    permutation = Array.from({ length: rows }, (_, i) => i);
    for (let i = rows - 1; i > 0; i--) {
      const j = Math.floor(random() * (i + 1));
      [permutation[i], permutation[j]] = [permutation[j], permutation[i]];
    }
    return permutation;
  } else return Array.from({ length: rows }, (_, i) => i);
  const seen = new Uint8Array(rows);
  const ok =
    permutation.length === rows &&
    Array.from(permutation).every((i) => Number.isInteger(Number(i)) && i >= 0 && i < rows && !seen[i]++);
  if (!ok) {
    throw new GraphkitWebError(
      `order for epoch ${epoch + 1} is not a permutation of the ${rows} rows (each index 0..${rows - 1} once).`,
    );
  }
  return Array.from(permutation, Number);
}

function mulberry32(seed) {
  let a = seed;
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function checkClasses(data, classes, where) {
  for (let i = 0; i < data.length; i++) {
    const label = Number(data[i]);
    if (label < 0 || label >= classes) {
      throw new GraphkitWebError(
        `${where} holds the label ${label} at row ${i}; the model has ${classes} classes, ` +
          `labels 0..${classes - 1}. Encode the classes as 0..${classes - 1} first.`,
      );
    }
  }
}

function predictions(output, prediction) {
  const rows = output.dims[0];
  const width = output.data.length / rows;
  const values = Array.from(output.data, Number);
  if (prediction.kind === "labels") {
    const labels = [];
    for (let r = 0; r < rows; r++) {
      if (width === 1) labels.push(values[r] > prediction.threshold ? 1 : 0);
      else {
        let best = 0;
        for (let j = 1; j < width; j++) if (values[r * width + j] > values[r * width + best]) best = j;
        labels.push(best);
      }
    }
    return labels;
  }
  if (width === 1) return values;
  return Array.from({ length: rows }, (_, r) => values.slice(r * width, (r + 1) * width));
}

function isNamed(X, inputs) {
  return (
    X && typeof X === "object" && !Array.isArray(X) && !ArrayBuffer.isView(X) &&
    inputs.every((i) => i.name in X)
  );
}

function flatten(row) {
  if (typeof row === "number" || typeof row === "bigint") return [row];
  if (!Array.isArray(row) && !ArrayBuffer.isView(row)) return [row];
  if (row.length && (Array.isArray(row[0]) || ArrayBuffer.isView(row[0]))) return row.flat(Infinity);
  return row;
}

function positiveInteger(value, name, zero = false) {
  if (!Number.isInteger(value) || value < (zero ? 0 : 1)) {
    throw new GraphkitWebError(`${name} must be an integer >= ${zero ? 0 : 1}, got ${value}.`);
  }
}

function hex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// -- protocol buffers: just enough to write TensorProto initializers -------------------

function varint(value) {
  const out = [];
  let v = BigInt(value);
  while (v > 0x7fn) {
    out.push(Number(v & 0x7fn) | 0x80);
    v >>= 7n;
  }
  out.push(Number(v));
  return Uint8Array.from(out);
}

function field(number, bytes) {
  // a length-delimited field (wire type 2)
  return concat([varint((number << 3) | 2), varint(bytes.length), bytes]);
}

function encodeTensor(name, tensor) {
  const parts = tensor.dims.map((d) => concat([varint(1 << 3), varint(d)])); // dims = 1
  parts.push(concat([varint(2 << 3), varint(ONNX_TYPES[tensor.type])])); // data_type = 2
  parts.push(field(8, new TextEncoder().encode(name))); // name = 8
  const data = tensor.data;
  parts.push(field(9, new Uint8Array(data.buffer, data.byteOffset, data.byteLength))); // raw_data
  return concat(parts);
}

function concat(chunks) {
  const out = new Uint8Array(chunks.reduce((n, c) => n + c.length, 0));
  let at = 0;
  for (const chunk of chunks) {
    out.set(chunk, at);
    at += chunk.length;
  }
  return out;
}
