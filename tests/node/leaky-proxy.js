#!/usr/bin/env node
// leaky-proxy.js: the platform proxy of incident 1 as it really ran, on Node.js (comm `node`),
// standard library only.
//
//   node leaky-proxy.js [--listen 127.0.0.1:8080] [--upstream 127.0.0.1:25001]
//
// The same command line as the Rust `leaky-proxy`, so the harness starts either. An HTTP
// server; for each request it opens ONE new upstream connection (`http.request` with
// `agent: false`: no keep-alive pool, one socket per request, closed when the upstream
// response ends) to the relay's dial slot (or a Service's ClusterIP standing for it), and
// pipes the upstream response back.
//
// The modelled bug: when the client goes away, nothing aborts or destroys the upstream
// request (no `res.on('close', () => upstream.destroy())`). The upstream socket is released
// only when the upstream response ends; a quiet SSE page whose user left therefore holds an
// idle ESTABLISHED proxy -> relay connection, and one of the relay's streams, forever. What
// the upstream still sends after the client left is read and dropped.
//
// If the upstream closes or resets before any response (the relay refusing a dial: "busy"),
// the client gets 503 with the body `busy`; if it cannot be reached at all, 502.
//
// Prints `ready` on stdout once listening.
'use strict';

const http = require('http');

const USAGE = 'usage: node leaky-proxy.js [--listen HOST:PORT] [--upstream HOST:PORT]';

function hostPort(flag, value) {
  const m = /^\[?([^\]]*?)\]?:(\d+)$/.exec(value || '');
  if (!m || Number(m[2]) > 65535) {
    process.stderr.write(`leaky-proxy.js: ${flag} needs HOST:PORT, got ${JSON.stringify(value)}\n${USAGE}\n`);
    process.exit(2);
  }
  return { host: m[1], port: Number(m[2]) };
}

function parseArgs(argv) {
  const args = { listen: '127.0.0.1:8080', upstream: '127.0.0.1:25001' };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    if (flag === '-h' || flag === '--help') {
      process.stdout.write(`${USAGE}\n`);
      process.exit(0);
    }
    if (flag !== '--listen' && flag !== '--upstream') {
      process.stderr.write(`leaky-proxy.js: unknown option ${flag}\n${USAGE}\n`);
      process.exit(2);
    }
    args[flag.slice(2)] = argv[++i];
  }
  return { listen: hostPort('--listen', args.listen), upstream: hostPort('--upstream', args.upstream) };
}

const { listen, upstream } = parseArgs(process.argv.slice(2));

function answer(res, status, body) {
  if (res.headersSent || res.destroyed) {
    res.destroy();
    return;
  }
  res.writeHead(status, { 'Content-Type': 'text/plain', 'Content-Length': Buffer.byteLength(body), Connection: 'close' });
  res.end(body);
}

const server = http.createServer((req, res) => {
  const headers = Object.assign({}, req.headers, { host: `${upstream.host}:${upstream.port}` });
  // One fresh upstream connection per request: `agent: false`, no pool.
  const up = http.request({
    host: upstream.host,
    port: upstream.port,
    method: req.method,
    path: req.url,
    headers,
    agent: false,
  });
  up.on('response', (upRes) => {
    if (!res.destroyed) {
      res.writeHead(upRes.statusCode, upRes.headers);
      // Send the head now, as an SSE-aware proxy does: a quiet stream has no body to carry it.
      res.flushHeaders();
    }
    upRes.on('data', (chunk) => {
      // Once the client is gone the bytes are dropped; the upstream is kept reading (and so
      // stays open, queues empty) until its response ends.
      if (!res.destroyed && !res.writableEnded) {
        res.write(chunk);
      }
    });
    upRes.on('end', () => {
      if (!res.destroyed && !res.writableEnded) {
        res.end();
      }
    });
    upRes.on('error', () => res.destroy());
  });
  up.on('error', (e) => {
    // Before any response: the relay refused the dial (reset or closed at once), or there is
    // no relay at all.
    const refused = e.code === 'ECONNREFUSED' || e.code === 'EHOSTUNREACH' || e.code === 'ENETUNREACH' || e.code === 'ETIMEDOUT';
    answer(res, refused ? 502 : 503, refused ? `upstream ${upstream.host}:${upstream.port} unreachable: ${e.code}` : 'busy');
  });
  // THE BUG: no `res.on('close', () => up.destroy())`. The client going away is ignored here.
  res.on('error', () => {});
  req.on('error', () => {});
  req.pipe(up);
});

server.on('clientError', (err, socket) => socket.destroy());
server.listen(listen.port, listen.host, () => {
  process.stdout.write('ready\n');
});
server.on('error', (e) => {
  process.stderr.write(`leaky-proxy.js: listen ${listen.host}:${listen.port}: ${e.message}\n`);
  process.exit(1);
});
