// The interpreter driver for JavaScript contexts (crates/server/src/interpreter.rs).
// Started as `node -e DRIVER`; the first stdin line is a per-process nonce, each
// later line one run {"id", "code"}. Code runs in one persistent `vm` context,
// so top-level declarations persist across runs. Protocol lines go to fd 1 as
// `NONCE {json}\n`; console output and process.stdout/stderr writes of the code
// travel as JSON events (a child process writing to fd 1 directly shows up as
// plain lines, which the server takes as stdout). SIGINT stops the running
// code (vm breakOnSigint, or abandons an awaited promise).
'use strict';
const fs = require('fs');
const vm = require('vm');
const util = require('util');

let NONCE = null;
let running = null;
const queue = [];
let pending = '';

function emit(obj) {
  const data = Buffer.from(NONCE + ' ' + JSON.stringify(obj) + '\n');
  let off = 0;
  while (off < data.length) {
    try {
      off += fs.writeSync(1, data, off);
    } catch (e) {
      if (e.code !== 'EAGAIN') throw e;
    }
  }
}

function capture(stream, kind) {
  stream.write = function (chunk, encoding, cb) {
    const text = typeof chunk === 'string' ? chunk : Buffer.from(chunk).toString('utf8');
    if (text) emit({ k: kind, text });
    if (typeof encoding === 'function') encoding();
    else if (typeof cb === 'function') cb();
    return true;
  };
}

const sandbox = {
  console: new console.Console({ stdout: process.stdout, stderr: process.stderr }),
  require, process, Buffer, URL, URLSearchParams, TextEncoder, TextDecoder,
  setTimeout, clearTimeout, setInterval, clearInterval, setImmediate, clearImmediate,
  queueMicrotask, structuredClone, fetch: globalThis.fetch, module: { exports: {} },
};
sandbox.global = sandbox;
sandbox.globalThis = sandbox;
const context = vm.createContext(sandbox);

function errorEvent(e) {
  if (e instanceof Error || (e && typeof e === 'object' && 'stack' in e)) {
    return { k: 'error', name: String(e.name || 'Error'), value: String(e.message || ''),
             traceback: String(e.stack || '').split('\n')
               .filter((l) => !/\(?(node:|\[eval\])/.test(l)).join('\n') };
  }
  return { k: 'error', name: 'Error', value: util.inspect(e), traceback: '' };
}

function bundle(value) {
  const data = { 'text/plain': typeof value === 'string' ? util.inspect(value)
                 : util.inspect(value, { depth: 4, maxArrayLength: 200 }) };
  return data;
}

let interrupt = null;
process.on('SIGINT', () => { if (interrupt) interrupt(); });

async function runCell(req) {
  let status = 'ok';
  const events = [];
  try {
    const script = new vm.Script(req.code, { filename: 'cell-' + req.n + '.js' });
    let value = script.runInContext(context, { breakOnSigint: true, displayErrors: false });
    if (value && typeof value.then === 'function') {
      value = await new Promise((resolve, reject) => {
        interrupt = () => { const e = new Error('Script execution was interrupted by `SIGINT`');
                            e.name = 'Interrupted'; reject(e); };
        value.then(resolve, reject);
      });
    }
    if (value !== undefined) {
      context._ = value;
      events.push({ k: 'result', main: true, data: bundle(value) });
    }
  } catch (e) {
    status = 'error';
    events.push(errorEvent(e));
  } finally {
    interrupt = null;
  }
  await new Promise((r) => setImmediate(r));
  for (const ev of events) emit(ev);
  emit({ k: 'end', id: req.id, status });
}

async function pump() {
  if (running) return;
  while (queue.length) {
    const req = queue.shift();
    running = runCell(req);
    await running;
    running = null;
  }
}

let n = 0;
process.stdin.on('data', (chunk) => {
  pending += chunk.toString('utf8');
  let i;
  while ((i = pending.indexOf('\n')) >= 0) {
    const line = pending.slice(0, i);
    pending = pending.slice(i + 1);
    if (NONCE === null) {
      NONCE = line.trim();
      capture(process.stdout, 'stdout');
      capture(process.stderr, 'stderr');
      emit({ k: 'ready', pid: process.pid, language: 'javascript' });
      continue;
    }
    let req;
    try { req = JSON.parse(line); } catch (e) { continue; }
    n += 1;
    req.n = n;
    queue.push(req);
  }
  pump();
});
process.stdin.on('end', () => process.exit(0));
process.on('uncaughtException', (e) => {
  try { emit({ k: 'stderr', text: 'Uncaught ' + (e && e.stack || String(e)) + '\n' }); } catch (_) { /* gone */ }
});
process.on('unhandledRejection', (e) => {
  try { emit({ k: 'stderr', text: 'Unhandled rejection: ' + (e && e.stack || String(e)) + '\n' }); } catch (_) { /* gone */ }
});
