"use strict";
// The report's two interactive parts, computed in the browser from what Python embedded in
// #report-data (nothing is fetched): the number-format explorer, which rounds exactly as
// `zerojax formats` (numpy / ml_dtypes) does and prints what its --json prints, and the ZeRO
// memory calculator, which is `zerojax memory`'s formula (docs/design.md section 2).

const DATA = JSON.parse(document.getElementById("report-data").textContent);

// ---------------------------------------------------------------------------------------------
// Numbers as Python reads and writes them.

/** Python's float(text): decimals (underscores between digits allowed), inf, infinity, nan,
 *  with a sign. Returns {value, negative} or null; `negative` also keeps the sign of a NaN,
 *  which a JS NaN cannot carry (Python's float("-nan") has its sign bit set). */
function parsePython(text) {
  const t = text.trim();
  const special = /^([+-]?)(inf|infinity|nan)$/i.exec(t);
  if (special) {
    const negative = special[1] === "-";
    const value = special[2].toLowerCase() === "nan" ? NaN : negative ? -Infinity : Infinity;
    return { value, negative };
  }
  const d = "\\d(?:_?\\d)*";
  const decimal = new RegExp(`^[+-]?(?:${d}(?:\\.(?:${d})?)?|\\.${d})(?:[eE][+-]?${d})?$`);
  if (!decimal.test(t)) return null;
  return { value: Number(t.replace(/_/g, "")), negative: t.startsWith("-") };
}

/** repr() of a finite float, which is what json.dumps writes: the shortest digits that read
 *  back to the same double (toExponential() with no argument gives exactly those), in fixed
 *  notation with at least one decimal when the exponent is in [-4, 16), else d.ddde-XX. */
function pyRepr(v) {
  if (v === 0) return Object.is(v, -0) ? "-0.0" : "0.0";
  const [mantissa, exp] = v.toExponential().split("e");
  const sign = v < 0 ? "-" : "";
  const digits = mantissa.replace("-", "").replace(".", "");
  const e = Number(exp);
  if (e < -4 || e >= 16) {
    const m = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    return `${sign}${m}e${e < 0 ? "-" : "+"}${String(Math.abs(e)).padStart(2, "0")}`;
  }
  if (e < 0) return `${sign}0.${"0".repeat(-e - 1)}${digits}`;
  if (digits.length <= e + 1) return `${sign}${digits}${"0".repeat(e + 1 - digits.length)}.0`;
  return `${sign}${digits.slice(0, e + 1)}.${digits.slice(e + 1)}`;
}

/** What `zerojax formats --json` writes for `stored`: the number, or "inf" / "-inf" / "nan". */
function jsonNumber(v) {
  if (Number.isNaN(v)) return "nan";
  if (!Number.isFinite(v)) return v > 0 ? "inf" : "-inf";
  return pyRepr(v);
}

// ---------------------------------------------------------------------------------------------
// Rounding into a format: round to nearest, ties to even, as numpy and ml_dtypes cast.

/** floor(log2(|x|)) for a finite nonzero double, exactly: read from its exponent bits. */
function binade(x) {
  const view = new DataView(new ArrayBuffer(8));
  view.setFloat64(0, x);
  const biased = (view.getUint16(0) >> 4) & 0x7ff;
  return biased === 0 ? binade(x * 2 ** 64) - 64 : biased - 1023; // subnormal double: scale up
}

/** The value format `f` holds for the double `x`. Every step is exact in doubles: the spacing
 *  of `f` near x is a power of two, so x / spacing only moves the binary point, and the
 *  integer part and the remainder against 1/2 decide the rounding. Beyond the largest finite
 *  value: +-Infinity, or NaN in a format without infinities (E4M3). */
function roundTo(f, x) {
  if (f.via_float32) x = Math.fround(x); // ml_dtypes rounds to float32 first (formats.rounds_via_float32)
  if (Number.isNaN(x)) return NaN;
  if (!Number.isFinite(x)) return f.has_inf ? x : NaN;
  if (x === 0) return x;
  const emin = 2 - 2 ** (f.exponent_bits - 1); // 1 - bias: below it, subnormals share one spacing
  const spacing = 2 ** (Math.max(binade(x), emin) - f.mantissa_bits);
  const units = Math.abs(x) / spacing;
  const whole = Math.floor(units);
  const rest = units - whole;
  const rounded = rest > 0.5 || (rest === 0.5 && whole % 2 === 1) ? whole + 1 : whole;
  const held = Math.sign(x) * rounded * spacing; // 0 * -1 keeps the sign: -0.0
  if (Math.abs(held) > f.max) return f.has_inf ? Math.sign(x) * Infinity : NaN;
  return held;
}

/** The sign, exponent and mantissa bits of `held`, a value of format `f`, as "0"/"1" strings.
 *  A NaN is the quiet NaN numpy writes (top mantissa bit), or E4M3's only one (all ones). */
function fieldsOf(f, held, negative) {
  const e = f.exponent_bits, m = f.mantissa_bits;
  const sign = negative ? "1" : "0";
  if (Number.isNaN(held)) return [sign, "1".repeat(e), f.has_inf ? "1" + "0".repeat(m - 1) : "1".repeat(m)];
  if (!Number.isFinite(held)) return [sign, "1".repeat(e), "0".repeat(m)];
  if (held === 0) return [sign, "0".repeat(e), "0".repeat(m)];
  const bias = 2 ** (e - 1) - 1, a = Math.abs(held);
  const normal = binade(a) >= 1 - bias;
  const exponent = normal ? binade(a) : 1 - bias;
  const significand = a / 2 ** (exponent - m); // an integer: the value in units of the last place
  const bits = (v, width) => v.toString(2).padStart(width, "0");
  return [sign, bits(normal ? exponent + bias : 0, e), bits(normal ? significand - 2 ** m : significand, m)];
}

/** One row of `zerojax formats --json`: {bits, stored, rel_error, status} (formats.store). */
function store(f, parsed) {
  const x = parsed.value, held = roundTo(f, x);
  let status = "ok";
  if (Number.isNaN(held) && !Number.isNaN(x)) status = "nan";
  else if (!Number.isFinite(held) && !Number.isNaN(held) && Number.isFinite(x)) status = "overflow";
  else if (held === 0 && x !== 0) status = "underflow";
  let relError = null;
  if (x === 0 && held === 0) relError = 0;
  else if (x !== 0 && Number.isFinite(x) && Number.isFinite(held)) relError = Math.abs(held - x) / Math.abs(x);
  return { fields: fieldsOf(f, held, parsed.negative), stored: jsonNumber(held), relError, status };
}

// ---------------------------------------------------------------------------------------------
// The format explorer.

const FIELD_CLASSES = ["sign", "exponent", "mantissa"];

function buildFormatRows() {
  const rows = document.getElementById("format-rows");
  for (const f of DATA.formats) {
    const row = document.createElement("div");
    row.className = "format";
    row.dataset.format = f.name;
    row.innerHTML =
      `<div class="format-name">${f.label}<small>1 + ${f.exponent_bits} + ${f.mantissa_bits} bits</small></div>` +
      `<div class="bits"></div><div class="stored"></div><div class="rel-error"></div><div class="status"></div>`;
    rows.appendChild(row);
  }
}

function showValue(text) {
  const parsed = parsePython(text);
  const error = document.getElementById("value-error");
  error.textContent = parsed ? "" : `'${text}' is not a number; give values like 0.1, 70000, 1e-8 or -3.5`;
  for (const f of DATA.formats) {
    const row = document.querySelector(`[data-format="${f.name}"]`);
    const cell = parsed ? store(f, parsed) : null;
    const bits = row.querySelector(".bits");
    bits.replaceChildren();
    (cell ? cell.fields : ["", "", ""]).forEach((field, k) => {
      const group = document.createElement("span");
      group.className = `field ${FIELD_CLASSES[k]}`;
      for (const b of field) {
        const bit = document.createElement("span");
        bit.className = `bit ${FIELD_CLASSES[k]}${b === "1" ? " one" : ""}`;
        bit.textContent = b;
        group.appendChild(bit);
      }
      bits.appendChild(group);
    });
    row.dataset.bits = cell ? cell.fields.join(" ") : "";
    row.querySelector(".stored").textContent = cell ? cell.stored : "";
    const rel = row.querySelector(".rel-error");
    rel.textContent = !cell ? "" : cell.relError === null ? "–" : cell.relError === 0 ? "0" : cell.relError.toExponential(2);
    rel.dataset.value = !cell ? "" : cell.relError === null ? "null" : pyRepr(cell.relError);
    const status = row.querySelector(".status");
    status.textContent = cell ? cell.status : "";
    status.dataset.status = cell ? cell.status : "";
  }
}

function setupExplorer() {
  buildFormatRows();
  const input = document.getElementById("value");
  input.addEventListener("input", () => showValue(input.value));
  for (const button of document.querySelectorAll("#examples button")) {
    button.addEventListener("click", () => {
      input.value = button.dataset.value;
      showValue(input.value);
    });
  }
  showValue(input.value);
}

// ---------------------------------------------------------------------------------------------
// The ZeRO memory calculator: model states per device (accounting.model_state_bytes).

const COUNT_SUFFIXES = { k: 1e3, m: 1e6, b: 1e9, g: 1e9, t: 1e12 };

/** cli.parse_count: 7.5e9, 124M, 3B, 1.5T (a trailing B after K/M/G/T is a byte size). */
function parseCount(text) {
  let t = text.trim();
  if (["kb", "mb", "gb", "tb"].includes(t.slice(-2).toLowerCase())) t = t.slice(0, -1);
  const scale = COUNT_SUFFIXES[t.slice(-1).toLowerCase()] || 1;
  const number = parsePython(scale !== 1 ? t.slice(0, -1) : t);
  return number && Number.isFinite(number.value) && number.value > 0 ? number.value * scale : null;
}

/** Bytes per device under ZeRO `stage`: 2-byte params and grads, K bytes of optimizer state
 *  (Rajbhandari et al. 2019, section 5), written in the order Python evaluates them. */
function modelStateBytes(stage, psi, n, k) {
  return [(2 + 2 + k) * psi, (2 + 2) * psi + k * psi / n, 2 * psi + (2 + k) * psi / n, (2 + 2 + k) * psi / n][stage];
}

function gbText(gb) {
  return gb >= 100 ? String(Math.round(gb)) : String(Number(gb.toPrecision(3)));
}

function showMemory() {
  const psi = parseCount(document.getElementById("psi").value);
  const devicesText = document.getElementById("devices").value.trim();
  const devices = /^\d+$/.test(devicesText) && Number(devicesText) >= 1 ? Number(devicesText) : null;
  const k = parsePython(document.getElementById("k").value);
  const problems = [];
  if (psi === null) problems.push("Ψ: give a count such as 7.5e9, 124M or 3B");
  if (devices === null) problems.push("N: give a whole number of devices, at least 1");
  if (!k || !Number.isFinite(k.value) || k.value < 0) problems.push("K: give bytes per parameter, at least 0 (Adam: 12)");
  document.getElementById("memory-error").textContent = problems.join("; ");
  const ok = problems.length === 0;
  const bytes = ok ? [0, 1, 2, 3].map((s) => modelStateBytes(s, psi, devices, k.value)) : [];
  const top = Math.max(...bytes, 0) || 1;
  for (let s = 0; s < 4; s++) {
    const bar = document.querySelector(`[data-stage="${s}"]`);
    bar.querySelector(".fill").style.width = ok ? `${(100 * bytes[s]) / top}%` : "0";
    bar.querySelector(".gb").textContent = ok ? `${gbText(bytes[s] / 1e9)} GB` : "–";
    bar.dataset.gb = ok ? String(bytes[s] / 1e9) : "";
    bar.dataset.bytes = ok ? pyRepr(bytes[s]) : "";
  }
  document.getElementById("memory-summary").textContent = ok
    ? `Ψ = ${psi.toLocaleString("en-US")} parameters on N = ${devices} devices, K = ${k.value}: ` +
      `stage 3 holds ${gbText(bytes[3] / 1e9)} GB per device, 1/${Number((bytes[0] / bytes[3]).toPrecision(3))} of stage 0.`
    : "";
}

function setupCalculator() {
  for (const id of ["psi", "devices", "k"]) document.getElementById(id).addEventListener("input", showMemory);
  document.getElementById("preset").addEventListener("click", () => {
    document.getElementById("psi").value = DATA.paper.psi;
    document.getElementById("devices").value = DATA.paper.devices;
    document.getElementById("k").value = DATA.paper.k;
    showMemory();
  });
  showMemory();
}

setupExplorer();
setupCalculator();
