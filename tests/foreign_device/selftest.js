#!/usr/bin/env node
// Rebuilds the worked examples of docs/PROTOCOL.md section 11 with device.js's own encoder and
// compares them byte for byte with the document's hex; reads the server's examples back with
// device.js's decoder. Prints one line per example and exits non-zero on any difference.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const dev = require('./device.js');

const doc = fs.readFileSync(path.join(__dirname, '..', '..', 'docs', 'PROTOCOL.md'), 'utf8');

function example(name) {
  const start = doc.indexOf(`<!-- example: ${name} -->`);
  if (start < 0) throw new Error(`no example ${name} in PROTOCOL.md`);
  const block = doc.slice(start, doc.indexOf('```\n', doc.indexOf('```text', start) + 7));
  const hex = block.slice(block.indexOf('\nhex:\n') + 6).split('\n')
    .filter((l) => /^[0-9a-f]{4}  /.test(l)).map((l) => l.slice(6).replace(/ /g, '')).join('');
  return Buffer.from(hex, 'hex');
}

const ID = (n) => n.toString(16).padStart(32, '0');
let failures = 0;
function check(name, built) {
  const want = example(name);
  const same = built.equals(want);
  if (!same) {
    failures++;
    let i = 0;
    while (i < Math.min(built.length, want.length) && built[i] === want[i]) i++;
    console.log(`${name}: DIFFERS (${built.length} vs ${want.length} bytes, first difference at ${i})`);
  } else {
    console.log(`${name}: identical (${built.length} bytes)`);
  }
}

function upload(name, round, id, kind, meta, tensors) {
  const {body, manifest} = dev.encodeMessage(kind, round, 'client-0', ID(id), meta, tensors);
  const packed = dev.packEnvelope({type: 'upload', federation: 'demo', round, sender: 'client-0', message_id: ID(id),
    reply_to: null, model_version: round, codec: 'safetensors', tensors: manifest}, body);
  check(name, packed);
}

upload('upload-class-logits', 2, 0x201, 'class_logits', {arch: 'mlp', num_samples: 200, train_loss: 0.5}, [
  {name: 'logits', dtype: 'F32', shape: [2, 3], values: [2.0, -1.0, 0.5, 0.25, 1.5, -0.75]},
  {name: 'classes', dtype: 'I64', shape: [2], values: [0, 2]},
  {name: 'counts', dtype: 'I64', shape: [2], values: [120, 80]},
]);
upload('upload-evaluation', 2, 0x301, 'evaluation', {eval_accuracy: 0.75, num_samples: 121}, []);
upload('upload-status', 1, 0x101, 'status', {arch: 'mlp', eval_accuracy: 0.875, num_samples: 386, train_loss: 0.5}, []);

// the server's messages, read back
for (const name of ['round', 'download-none', 'download-fedhe-first', 'download-fedhe', 'evaluate', 'ack', 'ack-late',
  'nack', 'nack-unreadable', 'nack-missing', 'done']) {
  try {
    const {header, body} = dev.unpackEnvelope(example(name));
    let what = `${header.type} round ${header.round}`;
    if (header.codec === 'safetensors') {
      const m = dev.decodeMessage(body);
      what += `, ${m.kind} [${Object.entries(m.tensors).map(([k, t]) => `${k} ${t.dtype} ${JSON.stringify(t.shape)}`)}]`;
    }
    console.log(`${name}: read (${what})`);
  } catch (err) {
    failures++;
    console.log(`${name}: UNREADABLE: ${err.message}`);
  }
}
console.log(failures ? `${failures} example(s) differ` : 'every example matches');
process.exit(failures ? 1 : 0);
