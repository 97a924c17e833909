#!/usr/bin/env node
// An edgefl device written in JavaScript from docs/PROTOCOL.md alone (and docs/config.md for the
// config keys), without the Python sources: it takes part in a FedHe fleet and FABRICATES its
// uploads (no training). It checks that the document is enough to write a device in another
// language (tests/test_foreign_device.py runs two of these against the real server).
//
//   node device.js --broker mqtt://127.0.0.1:PORT --federation NAME --device-id client-0 \
//                  --num-samples N [--classes C] [--epochs E] [--protocol 5|3.1.1]
//                  [--keepalive 30] [--ack-timeout 10] [--timeout 300]
//
// Exit codes: 0 the run is over (the final round announcement of a run this device took part in,
// every upload answered); 2 bad arguments; 3 an upload was refused (a nack without `missing`):
// the fabricated upload broke a rule; 4 timed out; 5 a broker or protocol error.
'use strict';

const crypto = require('node:crypto');
const mqtt = require('mqtt');

// ---- arguments ---------------------------------------------------------------------------------
function parseArgs(argv) {
  const opts = {classes: 10, epochs: 1, protocol: '5', keepalive: 30, ackTimeout: 10, timeout: 300};
  const names = {
    '--broker': 'broker', '--federation': 'federation', '--device-id': 'deviceId',
    '--num-samples': 'numSamples', '--classes': 'classes', '--epochs': 'epochs',
    '--protocol': 'protocol', '--keepalive': 'keepalive', '--ack-timeout': 'ackTimeout',
    '--timeout': 'timeout',
  };
  for (let i = 0; i < argv.length; i++) {
    const key = names[argv[i]];
    if (!key || i + 1 >= argv.length) fatal(2, `unknown or incomplete argument ${argv[i]}`);
    opts[key] = argv[++i];
  }
  for (const k of ['broker', 'federation', 'deviceId', 'numSamples']) {
    if (opts[k] === undefined) fatal(2, `missing --${k.replace(/[A-Z]/g, (c) => '-' + c.toLowerCase())}`);
  }
  for (const k of ['numSamples', 'classes', 'epochs', 'keepalive']) {
    opts[k] = Number(opts[k]);
    if (!Number.isInteger(opts[k]) || opts[k] < 1) fatal(2, `--${k} must be a positive integer`);
  }
  for (const k of ['ackTimeout', 'timeout']) {
    opts[k] = Number(opts[k]);
    if (!(opts[k] > 0)) fatal(2, `--${k} must be a positive number`);
  }
  if (opts.numSamples > 1e9) fatal(2, '--num-samples must be at most 10^9 (section 4.3)');
  // section 2: 1-64 characters of A-Z a-z 0-9 _ . -
  const NAME = /^[A-Za-z0-9_.-]{1,64}$/;
  if (!NAME.test(opts.federation)) fatal(2, `bad federation name ${JSON.stringify(opts.federation)}`);
  if (!NAME.test(opts.deviceId) || opts.deviceId === 'server') fatal(2, `bad device id ${JSON.stringify(opts.deviceId)}`);
  if (opts.protocol !== '5' && opts.protocol !== '3.1.1') fatal(2, '--protocol is 5 or 3.1.1');
  return opts;
}

function log(...parts) {
  console.log(`[${new Date().toISOString()}] ${OPTS ? OPTS.deviceId : 'device'}:`, ...parts);
}

let client = null;
function fatal(code, why) {
  console.error(`fatal: ${why}`);
  if (client && client.connected) {
    // a stop that is not clean for the run, but the broker still learns we are gone
    client.publish(TOPICS.presence, 'offline', {qos: 1, retain: true}, () => client.end(false, () => process.exit(code)));
    setTimeout(() => process.exit(code), 2000).unref();
  } else {
    process.exit(code);
  }
}

let OPTS = null;
let TOPICS = null;

// ---- JSON written the reference's way: sorted keys, no spaces (section 3) ----------------------
function canonical(value) {
  if (value === null || typeof value !== 'object') {
    if (typeof value === 'number' && !Number.isFinite(value)) throw new Error('non-finite number in JSON');
    return JSON.stringify(value);
  }
  if (Array.isArray(value)) return '[' + value.map(canonical).join(',') + ']';
  return '{' + Object.keys(value).sort().map((k) => JSON.stringify(k) + ':' + canonical(value[k])).join(',') + '}';
}

// the edgefl metadata string: sorted keys, ", " and ": " separators (section 4.1)
function pythonStyle(value) {
  if (value === null || typeof value !== 'object') return JSON.stringify(value);
  if (Array.isArray(value)) return '[' + value.map(pythonStyle).join(', ') + ']';
  return '{' + Object.keys(value).sort().map((k) => JSON.stringify(k) + ': ' + pythonStyle(value[k])).join(', ') + '}';
}

const sha256 = (buf) => crypto.createHash('sha256').update(buf).digest('hex');
const newId = () => crypto.randomUUID().replace(/-/g, '');

// ---- envelope (section 3) -------------------------------------------------------------------------
const MAGIC = Buffer.from('EDFL', 'ascii');
const MAX_HEADER = 65536;

function packEnvelope(fields, body) {
  const header = {...fields, body: {length: body.length, sha256: sha256(body)}};
  const raw = Buffer.from(canonical(header), 'utf8');
  if (raw.length > MAX_HEADER) throw new Error('envelope header too long');
  const len = Buffer.alloc(4);
  len.writeUInt32LE(raw.length, 0);
  return Buffer.concat([MAGIC, Buffer.from([1]), len, raw, body]);
}

const HEADER_FIELDS = new Set(['type', 'federation', 'round', 'sender', 'message_id', 'reply_to', 'model_version',
  'codec', 'body', 'tensors', 'chunk', 'status', 'reason', 'missing', 'info']);
const REQUIRED = ['type', 'federation', 'round', 'sender', 'message_id', 'reply_to', 'model_version', 'codec', 'body'];

function unpackEnvelope(buf) {
  if (buf.length < 9) throw new Error('truncated envelope');
  if (!buf.subarray(0, 4).equals(MAGIC)) throw new Error('bad magic');
  if (buf[4] !== 1) throw new Error(`envelope version ${buf[4]} is not 1`);
  const h = buf.readUInt32LE(5);
  if (h > MAX_HEADER || 9 + h > buf.length) throw new Error('bad header length');
  const header = JSON.parse(buf.subarray(9, 9 + h).toString('utf8'));
  if (header === null || typeof header !== 'object' || Array.isArray(header)) throw new Error('header is not an object');
  for (const k of Object.keys(header)) if (!HEADER_FIELDS.has(k)) throw new Error(`unknown header field ${k}`);
  for (const k of REQUIRED) if (!(k in header)) throw new Error(`header misses ${k}`);
  const body = buf.subarray(9 + h);
  if (header.body.length !== body.length) throw new Error('body length differs from the header');
  if (header.body.sha256 !== sha256(body)) throw new Error('body SHA-256 differs from the header');
  return {header, body};
}

// ---- safetensors bodies (section 4.1) --------------------------------------------------------------
const DTYPE_SIZE = {F32: 4, I64: 8, BOOL: 1};

// tensors: [{name, dtype, shape, values (flat, row-major)}]
function encodeMessage(kind, round, sender, messageId, meta, tensors) {
  const edgefl = {format: 'edgefl-message/1', kind, round, sender, message_id: messageId, meta};
  const header = {__metadata__: {edgefl: pythonStyle(edgefl)}};
  const parts = [];
  let offset = 0;
  // any order is allowed; group by dtype size, largest first, like the reference writer
  const ordered = [...tensors].sort((a, b) => DTYPE_SIZE[b.dtype] - DTYPE_SIZE[a.dtype] || (a.name < b.name ? -1 : 1));
  for (const t of ordered) {
    const n = t.shape.reduce((a, b) => a * b, 1);
    if (t.values.length !== n) throw new Error(`${t.name}: ${t.values.length} values for shape ${t.shape}`);
    const data = Buffer.alloc(n * DTYPE_SIZE[t.dtype]);
    t.values.forEach((v, i) => {
      if (t.dtype === 'F32') data.writeFloatLE(v, 4 * i);
      else if (t.dtype === 'I64') data.writeBigInt64LE(BigInt(v), 8 * i);
      else data.writeUInt8(v ? 1 : 0, i);
    });
    header[t.name] = {dtype: t.dtype, shape: t.shape, data_offsets: [offset, offset + data.length]};
    offset += data.length;
    parts.push(data);
  }
  let json = JSON.stringify(header);
  json += ' '.repeat((8 - (Buffer.byteLength(json) % 8)) % 8);
  const raw = Buffer.from(json, 'utf8');
  const n = Buffer.alloc(8);
  n.writeBigUInt64LE(BigInt(raw.length), 0);
  const manifest = {};
  for (const t of tensors) manifest[t.name] = [t.dtype, t.shape];
  return {body: Buffer.concat([n, raw, ...parts]), manifest};
}

function decodeMessage(body) {
  if (body.length < 8) throw new Error('safetensors body too short');
  const n = Number(body.readBigUInt64LE(0));
  if (n > (1 << 20) || 8 + n > body.length) throw new Error('bad safetensors header length');
  const header = JSON.parse(body.subarray(8, 8 + n).toString('utf8'));
  const md = header.__metadata__;
  if (!md || typeof md.edgefl !== 'string') throw new Error('no edgefl metadata');
  const message = JSON.parse(md.edgefl);
  if (message.format !== 'edgefl-message/1') throw new Error(`unknown message format ${message.format}`);
  const data = body.subarray(8 + n);
  const tensors = {};
  for (const [name, t] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const [start, end] = t.data_offsets;
    tensors[name] = {dtype: t.dtype, shape: t.shape, bytes: data.subarray(start, end)};
  }
  return {kind: message.kind, meta: message.meta, tensors};
}

// ---- what this device "has": a fixed, fabricated class mix ------------------------------------------
function seeded(text) {
  // a small deterministic generator (mulberry32) seeded by the device id
  let a = parseInt(sha256(text).slice(0, 8), 16);
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function fabricateClassLogits(C, round) {
  const rand = seeded(`${OPTS.deviceId}/${round}`);
  const pick = seeded(OPTS.deviceId); // the classes stay the same from round to round
  const k = Math.max(1, Math.min(C, OPTS.numSamples, 2 + Math.floor(pick() * 3)));
  const all = [...Array(C).keys()];
  for (let i = C - 1; i > 0; i--) {
    const j = Math.floor(pick() * (i + 1));
    [all[i], all[j]] = [all[j], all[i]];
  }
  const classes = all.slice(0, k).sort((a, b) => a - b);
  // counts: the device's samples split over its classes, every epoch counted: sums to num_samples x epochs
  const total = OPTS.numSamples * OPTS.epochs;
  const counts = classes.map(() => Math.floor(total / k));
  counts[0] += total - counts.reduce((a, b) => a + b, 0);
  const logits = [];
  for (const c of classes) {
    for (let j = 0; j < C; j++) logits.push((j === c ? 4 : -0.5) + (rand() - 0.5) * 0.2);
  }
  return {classes, counts, logits, k};
}

// ---- state ---------------------------------------------------------------------------------------------
let classesC = 10;
const seenRuns = new Set(); // runs announced (not done) or served
const served = new Map(); // `${run}/${type}/${round}` -> {id, packed}
const pending = new Map(); // message_id -> {packed, wait, timer, round}
let doneRun = null; // the run whose end was announced
let ackTimeoutMs = 10000;

function publishUp(packed) {
  client.publish(TOPICS.up, packed, {qos: 1, retain: false});
}

function track(id, packed, round) {
  const entry = {packed, wait: ackTimeoutMs, round, timer: null};
  const arm = () => {
    entry.timer = setTimeout(() => {
      // section 6.3: nothing within ack_timeout_s: resend the same bytes, double the wait (at most 120 s)
      log(`no answer to upload ${id} (round ${round}) in ${entry.wait / 1000} s: resending`);
      publishUp(entry.packed);
      entry.wait = Math.min(entry.wait * 2, 120000);
      arm();
    }, entry.wait);
  };
  pending.set(id, entry);
  arm();
}

function settle(id) {
  const entry = pending.get(id);
  if (entry) clearTimeout(entry.timer);
  pending.delete(id);
  maybeFinish();
}

function maybeFinish() {
  if (doneRun === null || pending.size > 0) return;
  log(`run ${doneRun} is over: stopping`);
  client.publish(TOPICS.presence, 'offline', {qos: 1, retain: true}, () => {
    client.end(false, () => process.exit(0));
  });
}

function buildUpload(header, kind, meta, tensors) {
  const id = newId();
  const round = header.round;
  const {body, manifest} = encodeMessage(kind, round, OPTS.deviceId, id, meta, tensors);
  const packed = packEnvelope({
    type: 'upload', federation: OPTS.federation, round, sender: OPTS.deviceId, message_id: id, reply_to: null,
    model_version: header.model_version, codec: 'safetensors', tensors: manifest,
  }, body);
  // section 5: larger envelopes travel in chunks, which this device does not do; its uploads are
  // a few hundred bytes, far below network.chunk_threshold (512 KiB)
  if (packed.length > 524288) fatal(5, `upload of ${packed.length} bytes would need chunking`);
  return {id, packed};
}

function handleDownload(header, body) {
  const run = header.info && header.info.run;
  if (typeof run === 'string') seenRuns.add(run);
  const key = `${run}/${header.type}/${header.round}`;
  const before = served.get(key);
  if (before) {
    // section 6.2: a repeated download of a served round gets the same upload (same ids, same bytes)
    log(`repeated ${header.type} for round ${header.round}: resending upload ${before.id}`);
    publishUp(before.packed);
    if (!pending.has(before.id) && !before.answered) track(before.id, before.packed, header.round);
    return;
  }
  let message = null;
  if (header.codec === 'safetensors') message = decodeMessage(body);
  if (header.type === 'evaluate') {
    // section 6.6: whatever the method, answer with an `evaluation` (no tensors)
    const meta = {num_samples: OPTS.numSamples, eval_accuracy: 0.5};
    const up = buildUpload(header, 'evaluation', meta, []);
    served.set(key, up);
    log(`evaluate for round ${header.round}: answering with evaluation ${up.id}`);
    publishUp(up.packed);
    track(up.id, up.packed, header.round);
    return;
  }
  if (message && message.kind !== 'class_logits') fatal(5, `this device speaks FedHe only, got a ${message.kind} download`);
  if (message && message.tensors.logits) {
    const shape = message.tensors.logits.shape;
    if (shape[0] !== classesC) log(`download's logits have ${shape[0]} rows: C = ${shape[0]}`);
    classesC = shape[0];
  }
  const {classes, counts, logits, k} = fabricateClassLogits(classesC, header.round);
  const meta = {num_samples: OPTS.numSamples, train_loss: 0.5, arch: 'js-fabricated'};
  if (header.info && header.info.evaluate === true) meta.eval_accuracy = 0.5; // section 6.2
  const up = buildUpload(header, 'class_logits', meta, [
    {name: 'logits', dtype: 'F32', shape: [k, classesC], values: logits},
    {name: 'classes', dtype: 'I64', shape: [k], values: classes},
    {name: 'counts', dtype: 'I64', shape: [k], values: counts},
  ]);
  served.set(key, up);
  log(`download for round ${header.round} (${message && Object.keys(message.tensors).length ? 'with' : 'no'} tensors`
      + `${meta.eval_accuracy !== undefined ? ', evaluate' : ''}): uploading ${up.id}, classes [${classes}]`);
  publishUp(up.packed);
  track(up.id, up.packed, header.round);
}

function findServed(id) {
  for (const up of served.values()) if (up.id === id) return up;
  return null;
}

function handle(topic, payload) {
  if (topic === TOPICS.presence) return;
  let env;
  try {
    env = unpackEnvelope(payload);
  } catch (err) {
    log(`ignored an unreadable message on ${topic}: ${err.message}`);
    return;
  }
  const {header, body} = env;
  if (header.sender !== 'server' || header.federation !== OPTS.federation) {
    log(`ignored a ${header.type} from ${header.sender} of federation ${header.federation}`);
    return;
  }
  switch (header.type) {
    case 'round': {
      const info = header.info || {};
      if (typeof info.classes === 'number') classesC = info.classes;
      if (info.done === true) {
        // section 6.1: only the end of a run this device has seen announced or served is its end
        if (seenRuns.has(info.run)) {
          log(`final announcement: run ${info.run} done after ${info.rounds} rounds`);
          doneRun = info.run;
          maybeFinish();
        } else {
          log(`ignored the end of another run (${info.run})`);
        }
      } else {
        seenRuns.add(info.run);
        log(`round ${header.round} announced, selected ${info.selected ? `[${info.selected}]` : `${info.selected_count} devices`}`);
      }
      break;
    }
    case 'download':
    case 'evaluate':
      handleDownload(header, body);
      break;
    case 'ack': {
      const up = findServed(header.reply_to);
      if (!up) {
        log(`ignored an ack of unknown message ${header.reply_to}`);
        break;
      }
      up.answered = true;
      log(`ack ${header.status} for round ${header.round}${header.reason ? ` (${header.reason})` : ''}`);
      settle(header.reply_to);
      break;
    }
    case 'nack': {
      if (header.reply_to === null) {
        log(`nack without reply_to: ${header.reason}`);
        break;
      }
      const up = findServed(header.reply_to);
      if (!up) {
        log(`ignored a nack of unknown message ${header.reply_to}: ${header.reason}`);
        break;
      }
      if (Array.isArray(header.missing)) {
        // section 5: resend exactly what `missing` lists; this device never chunks, so the one
        // envelope it sent is the whole upload
        log(`nack asks again for ${header.missing}: resending ${up.id}`);
        publishUp(up.packed);
        break;
      }
      up.answered = true;
      settle(header.reply_to);
      fatal(3, `upload ${up.id} for round ${header.round} refused: ${header.reason}`);
      break;
    }
    default:
      log(`ignored a ${header.type} envelope`);
  }
}

// ---- the connection (section 1) -----------------------------------------------------------------
const queue = [];
let draining = false;
function drain() {
  draining = false;
  while (queue.length) {
    const [topic, payload] = queue.shift();
    try {
      handle(topic, payload);
    } catch (err) {
      fatal(5, `while handling a message on ${topic}: ${err.stack || err}`);
    }
  }
}

function main() {
  OPTS = parseArgs(process.argv.slice(2));
  const root = `edgefl/v1/${OPTS.federation}`;
  TOPICS = {
    round: `${root}/round`,
    down: `${root}/dev/${OPTS.deviceId}/down`,
    up: `${root}/dev/${OPTS.deviceId}/up`,
    presence: `${root}/presence/${OPTS.deviceId}`,
  };
  classesC = OPTS.classes;
  ackTimeoutMs = OPTS.ackTimeout * 1000;

  // reconnect back-off: a floor of 1-3 s fixed per device id, doubling to 30 s
  const floorMs = 1000 + (parseInt(sha256(OPTS.deviceId).slice(0, 8), 16) % 2001);
  const connectOptions = {
    clientId: `edgefl-${OPTS.federation}-${OPTS.deviceId}`,
    protocolVersion: OPTS.protocol === '5' ? 5 : 4,
    clean: false,
    keepalive: OPTS.keepalive,
    reconnectPeriod: floorMs,
    connectTimeout: 10000,
    will: {topic: TOPICS.presence, payload: Buffer.from('offline'), qos: 1, retain: true},
  };
  if (OPTS.protocol === '5') connectOptions.properties = {sessionExpiryInterval: 3600};

  client = mqtt.connect(OPTS.broker, connectOptions);
  client.on('connect', (connack) => {
    client.options.reconnectPeriod = floorMs;
    log(`connected (session present: ${Boolean(connack.sessionPresent)})`);
    client.subscribe([TOPICS.down, TOPICS.round], {qos: 1}, (err) => {
      if (err) fatal(5, `subscribe failed: ${err.message}`);
      client.publish(TOPICS.presence, 'online', {qos: 1, retain: true}, () => log('online'));
    });
  });
  client.on('reconnect', () => {
    client.options.reconnectPeriod = Math.min(client.options.reconnectPeriod * 2, 30000);
  });
  client.on('error', (err) => log(`broker error: ${err.message}`));
  client.on('message', (topic, payload) => {
    // never block in the receive callback: queue and handle elsewhere
    queue.push([topic, Buffer.from(payload)]);
    if (!draining) {
      draining = true;
      setImmediate(drain);
    }
  });

  setTimeout(() => fatal(4, `the run did not end within ${OPTS.timeout} s`), OPTS.timeout * 1000).unref();
  // keep the process alive while the client runs (the timer above is unref'd)
  setInterval(() => {}, 1 << 30);
}

if (require.main === module) {
  main();
} else {
  // tests/foreign_device/selftest.js rebuilds the document's worked examples with these
  module.exports = {canonical, pythonStyle, packEnvelope, unpackEnvelope, encodeMessage, decodeMessage};
}
