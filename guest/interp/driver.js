// The interpreter driver for JavaScript and TypeScript contexts
// (crates/server/src/interpreter.rs). Started as `node -e DRIVER [typescript]`;
// the first stdin line is a per-process nonce, each later line one run
// {"id", "code"}. Code runs in one persistent `vm` context, so top-level
// declarations persist across runs. TypeScript is transpiled cell by cell with
// the image's `typescript` package (types are erased, not checked), then runs
// as JavaScript. Static `import` declarations become `require` calls bound
// with `var`, so a module imported in one cell stays there for the next.
// Protocol lines go to the original stdout as `NONCE {json}\n`; fds 1 and 2
// are FIFOs read by a worker thread, so what the code or a child process
// writes there travels as JSON `stdout` and `stderr` events and cannot forge
// or cut a protocol line. SIGINT stops the running code (vm breakOnSigint, or
// abandons an awaited promise), also when it comes while the cell is
// transpiled or compiled or as its script ends.
'use strict';
const fs = require('fs');
const vm = require('vm');
const util = require('util');

// Output. Protocol lines go to a descriptor of their own (opened anew on the
// original stdout). Fds 1 and 2 become FIFOs that a worker thread reads, and
// process.stdout and process.stderr write to them at once: what the code and
// its child processes print travels as events, in the order written. Before
// a run ends the driver writes a marker to both and waits until the worker
// has passed it. Without /proc or mkfifo, process.stdout and process.stderr
// writes travel as events as before, and a child process writing to fd 1
// writes to the protocol stream itself.
const SHARED = new Int32Array(new SharedArrayBuffer(12)); // emit lock, markers passed on fds 1 and 2
const MARKER = Buffer.from('\0' + require('crypto').randomBytes(16).toString('hex') + '\0');
let PROTO = 1;
let RAW_STDERR = 2; // the original stderr: what the server must get as it is
let READERS = null; // the FIFOs' read ends, once fds 1 and 2 are FIFOs

function writeAll(fd, data) {
  let off = 0;
  while (off < data.length) {
    try {
      off += fs.writeSync(fd, data, off);
    } catch (e) {
      if (e.code !== 'EAGAIN') throw e;
      Atomics.wait(SHARED, 0, -1, 1); // full and non-blocking: a millisecond
    }
  }
}

function isolate() {
  const { O_WRONLY, O_RDONLY, O_APPEND, O_NONBLOCK } = fs.constants;
  const opened = [];
  let dir = null;
  try {
    const proto = fs.openSync('/proc/self/fd/1', O_WRONLY | O_APPEND);
    opened.push(proto);
    const err = fs.openSync('/proc/self/fd/2', O_WRONLY | O_APPEND);
    opened.push(err);
    dir = fs.mkdtempSync(require('path').join(require('os').tmpdir(), '.runtime-js-'));
    const paths = [dir + '/1', dir + '/2'];
    require('child_process').execFileSync('mkfifo', ['-m', '600', ...paths], { stdio: 'ignore' });
    const readers = paths.map((p) => { const fd = fs.openSync(p, O_RDONLY | O_NONBLOCK); opened.push(fd); return fd; });
    for (const [i, fd] of [[0, 1], [1, 2]]) {
      fs.closeSync(fd);
      // The lowest free descriptor: fd again, now the FIFO's write end.
      const w = fs.openSync(paths[i], O_WRONLY);
      if (w !== fd) {
        writeAll(err, Buffer.from(`runtime: fd ${fd} could not be replaced\n`));
        process.exit(1);
      }
    }
    for (const p of paths) fs.unlinkSync(p);
    fs.rmdirSync(dir);
    PROTO = proto;
    RAW_STDERR = err;
    READERS = readers;
  } catch (e) {
    for (const fd of opened) { try { fs.closeSync(fd); } catch (_) { /* gone */ } }
    if (dir) fs.rmSync(dir, { recursive: true, force: true });
    return;
  }
  // A write goes to the descriptor at once, with no state in the stream: a
  // script that SIGINT terminates halfway through one leaves nothing behind.
  const { Writable } = require('stream');
  for (const [name, fd] of [['stdout', 1], ['stderr', 2]]) {
    const out = new Writable();
    out.write = function (chunk, encoding, cb) {
      if (typeof encoding === 'function') { cb = encoding; encoding = undefined; }
      writeAll(fd, typeof chunk === 'string' ? Buffer.from(chunk, encoding || 'utf8') : Buffer.from(chunk));
      if (typeof cb === 'function') process.nextTick(cb);
      return true;
    };
    out.fd = fd;
    out.isTTY = false;
    Object.defineProperty(process, name, { configurable: true, enumerable: true, get: () => out });
  }
}
isolate();

// The worker thread that turns what comes through the FIFOs into events.
const RELAY = `
const { workerData } = require('worker_threads');
const fs = require('fs');
const net = require('net');
const { nonce, proto, readers, marker, shared } = workerData;
const S = new Int32Array(shared);
const M = Buffer.from(marker);
function emit(obj) {
  const data = Buffer.from(nonce + ' ' + JSON.stringify(obj) + '\\n');
  while (Atomics.compareExchange(S, 0, 0, 1) !== 0) Atomics.wait(S, 0, 1, 10);
  try {
    let off = 0;
    while (off < data.length) off += fs.writeSync(proto, data, off);
  } finally {
    Atomics.store(S, 0, 0);
    Atomics.notify(S, 0);
  }
}
readers.forEach((fd, i) => {
  const kind = i === 0 ? 'stdout' : 'stderr';
  const decoder = new TextDecoder();
  let buf = Buffer.alloc(0);
  const out = (b, final) => {
    const text = decoder.decode(b, { stream: !final });
    if (text) emit({ k: kind, text });
  };
  const pipe = new net.Socket({ fd, readable: true, writable: false });
  pipe.on('data', (chunk) => {
    buf = buf.length ? Buffer.concat([buf, chunk]) : chunk;
    let j;
    while ((j = buf.indexOf(M)) >= 0) {
      out(buf.subarray(0, j), true);
      buf = buf.subarray(j + M.length);
      Atomics.add(S, 1 + i, 1);
      Atomics.notify(S, 1 + i);
    }
    let keep = 0; // a tail that may begin the marker
    for (let k = Math.min(M.length - 1, buf.length); k > 0; k--) {
      if (M.subarray(0, k).equals(buf.subarray(buf.length - k))) { keep = k; break; }
    }
    out(buf.subarray(0, buf.length - keep), false);
    buf = buf.subarray(buf.length - keep);
  });
  pipe.on('error', () => {});
});
`;

function startRelay() {
  if (!READERS) return;
  const { Worker } = require('worker_threads');
  const worker = new Worker(RELAY, {
    eval: true,
    workerData: { nonce: NONCE, proto: PROTO, readers: READERS, marker: MARKER, shared: SHARED.buffer },
  });
  worker.on('error', (e) => { writeAll(RAW_STDERR, Buffer.from('runtime: output relay failed: ' + e + '\n')); process.exit(1); });
  worker.unref();
}

// Waits until the worker has passed on what fds 1 and 2 got so far.
function passOutput() {
  if (!READERS) return;
  for (const i of [0, 1]) {
    const want = Atomics.load(SHARED, 1 + i) + 1;
    writeAll(1 + i, MARKER);
    const until = Date.now() + 10000;
    while (Atomics.load(SHARED, 1 + i) < want && Date.now() < until) Atomics.wait(SHARED, 1 + i, want - 1, 100);
  }
}

const LANGUAGE = process.argv[1] === 'typescript' ? 'typescript' : 'javascript';
let ts = null;
if (LANGUAGE === 'typescript') {
  for (const name of ['typescript', '/usr/share/nodejs/typescript', '/usr/lib/nodejs/typescript']) {
    try { ts = require(name); break; } catch (e) { /* next */ }
  }
}

let NONCE = null;
let running = null;
const queue = [];
let pending = '';

function emit(obj) {
  const data = Buffer.from(NONCE + ' ' + JSON.stringify(obj) + '\n');
  if (!READERS) return writeAll(PROTO, data); // (also from a script SIGINT may terminate)
  while (Atomics.compareExchange(SHARED, 0, 0, 1) !== 0) Atomics.wait(SHARED, 0, 1, 10);
  try {
    writeAll(PROTO, data);
  } finally {
    Atomics.store(SHARED, 0, 0);
    Atomics.notify(SHARED, 0);
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
sandbox.exports = sandbox.module.exports;
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

// `import x from 'm'`, `import * as x from 'm'`, `import {a, b as c} from 'm'`,
// `import x, {a} from 'm'`, `import 'm'` at the start of a line; `export`
// before a declaration is dropped (a cell is not a module).
function unmodule(code) {
  const req = (m) => `require(${m})`;
  return code
    .replace(/^[ \t]*import\s+(?:type\s+)?([\w$]+\s*,\s*)?(\*\s+as\s+[\w$]+|\{[^}]*\}|[\w$]+)\s+from\s+(['"][^'"]+['"])\s*;?/gm,
      (all, first, what, m) => {
        const out = [];
        if (first) out.push(`var ${first.replace(/[\s,]/g, '')} = __rtDefault(${req(m)});`);
        if (what.startsWith('*')) out.push(`var ${what.replace(/^\*\s+as\s+/, '')} = ${req(m)};`);
        else if (what.startsWith('{')) {
          const names = what.slice(1, -1).split(',').map((p) => p.trim()).filter(Boolean)
            .filter((p) => !p.startsWith('type '))
            .map((p) => p.replace(/\s+as\s+/, ': '));
          if (names.length) out.push(`var {${names.join(', ')}} = ${req(m)};`);
        } else out.push(`var ${what} = __rtDefault(${req(m)});`);
        return out.join(' ');
      })
    .replace(/^[ \t]*import\s+(['"][^'"]+['"])\s*;?/gm, (all, m) => `${req(m)};`)
    .replace(/^([ \t]*)export\s+(default\s+)?(?=(?:async\s+)?(?:function|class|const|let|var|enum|interface|type|abstract)\b)/gm, '$1');
}
sandbox.__rtDefault = (m) => (m && m.__esModule && 'default' in m ? m.default : m);

// A TypeScript cell as JavaScript, or an error event for its syntax errors.
function transpile(code, n) {
  const out = ts.transpileModule(unmodule(code), {
    fileName: 'cell-' + n + '.ts',
    reportDiagnostics: true,
    compilerOptions: {
      target: ts.ScriptTarget.ES2020, module: ts.ModuleKind.ESNext,
      esModuleInterop: true, sourceMap: false, experimentalDecorators: true,
    },
  });
  const errors = (out.diagnostics || []).filter((d) => d.category === ts.DiagnosticCategory.Error);
  if (errors.length) {
    const lines = errors.map((d) => {
      const text = ts.flattenDiagnosticMessageText(d.messageText, '\n');
      if (!d.file || d.start === undefined) return `error TS${d.code}: ${text}`;
      const { line, character } = d.file.getLineAndCharacterOfPosition(d.start);
      return `cell-${n}.ts(${line + 1},${character + 1}): error TS${d.code}: ${text}`;
    });
    return { error: { k: 'error', name: 'TSError', value: lines[0].replace(/^[^:]*: /, ''), traceback: lines.join('\n') } };
  }
  return { code: out.outputText.replace(/^export \{\};\s*$/m, '') };
}

// SIGINT. The vm module catches it only while a script runs (breakOnSigint);
// around that it removes the process's 'SIGINT' listeners, so one that comes
// just before or as the script ends reached no one, or killed the driver.
// Instead node's SIGINT watchdog helper (what the REPL uses) runs for the
// driver's life: it takes every SIGINT, passes it to the running script's
// watchdog, and otherwise keeps it pending for the driver to ask about.
let watchdog = null;
try {
  const b = process.binding('contextify');
  if (typeof b.watchdogHasPendingSigint === 'function') {
    if (b.startSigintWatchdog()) watchdog = b;
    else b.stopSigintWatchdog();
  }
} catch (e) { /* older or newer node: the 'SIGINT' listener below */ }
// Whether SIGINT came since the last call (and forgets it).
function sigintCame() {
  if (!watchdog) return false;
  watchdog.startSigintWatchdog();
  return watchdog.stopSigintWatchdog();
}
function interruptedError() {
  const e = new Error('Script execution was interrupted by `SIGINT`');
  e.name = 'Interrupted';
  e.stack = e.name + ': ' + e.message;
  return e;
}
let interrupt = null;
if (!watchdog) process.on('SIGINT', () => { if (interrupt) interrupt(); });

async function runCell(req) {
  let status = 'ok';
  const events = [];
  sigintCame();  // one that came between runs is not for this one
  try {
    let code = req.code;
    if (ts) {
      const t = transpile(code, req.n);
      if (t.error) throw Object.assign(new Error(t.error.value), { name: 'TSError', stack: t.error.traceback, tsError: true });
      code = t.code;
    } else if (/^[ \t]*(?:import|export)\s/m.test(code)) {
      code = unmodule(code);
    }
    const script = new vm.Script(code, { filename: 'cell-' + req.n + (ts ? '.ts' : '.js') });
    if (sigintCame()) throw interruptedError();
    let value = script.runInContext(context, { breakOnSigint: true, displayErrors: false });
    if (sigintCame()) throw interruptedError();
    if (value && typeof value.then === 'function') {
      let poll = null;
      try {
        value = await new Promise((resolve, reject) => {
          interrupt = () => reject(interruptedError());
          if (watchdog) poll = setInterval(() => { if (watchdog.watchdogHasPendingSigint()) interrupt(); }, 20);
          value.then(resolve, reject);
        });
      } finally {
        clearInterval(poll);
      }
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
  passOutput();
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
      if (LANGUAGE === 'typescript' && !ts) {
        writeAll(RAW_STDERR, Buffer.from('the typescript package is not installed\n'));
        process.exit(1);
      }
      if (READERS) {
        startRelay();
      } else {
        capture(process.stdout, 'stdout');
        capture(process.stderr, 'stderr');
      }
      emit({ k: 'ready', pid: process.pid, language: LANGUAGE });
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
