#!/usr/bin/env node
// retry-gateway.js: the API gateway of incident 4 as it ran, on Node.js (comm `node`),
// standard library only.
//
//   node retry-gateway.js --listen HOST:PORT --upstreams H:P,H:P,... [--retries N]
//                         [--backoff-ms MIN-MAX]
//
// An HTTP server; each request is routed to one upstream node picked at random, over a new
// connection (`agent: false`: no pool, as the gateway ran). When the attempt fails (refused,
// reset, closed before an answer), it is retried after a random backoff, up to --retries
// times.
//
// The modelled bug: the retry selector re-picks the node the previous attempt failed on
// (`pick(previous)` returns `previous` when there is one) instead of another one. A request
// routed to a broken node therefore hangs for the whole retry budget and then fails with 502,
// while the healthy nodes sit idle. A request routed to a healthy node is served (200, the
// upstream's body, header x-upstream).
//
// Prints `ready addr=HOST:PORT` on stdout once listening.
'use strict';

const http = require('http');

const USAGE = 'usage: node retry-gateway.js --listen HOST:PORT --upstreams H:P,H:P,... [--retries N] [--backoff-ms MIN-MAX]';

function fail(msg) {
  process.stderr.write(`retry-gateway.js: ${msg}\n${USAGE}\n`);
  process.exit(2);
}

function hostPort(value) {
  const m = /^([^:]+):(\d+)$/.exec(value || '');
  if (!m) fail(`expected HOST:PORT, got ${JSON.stringify(value)}`);
  return { host: m[1], port: Number(m[2]) };
}

function parseArgs(argv) {
  const args = { listen: null, upstreams: null, retries: '8', 'backoff-ms': '100-300' };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const key = flag.replace(/^--/, '');
    if (!(key in args) || flag === key) fail(`unknown option ${flag}`);
    args[key] = argv[++i];
  }
  const backoff = /^(\d+)-(\d+)$/.exec(args['backoff-ms']);
  if (!backoff) fail('--backoff-ms needs MIN-MAX');
  return {
    listen: hostPort(args.listen),
    upstreams: (args.upstreams || '').split(',').filter(Boolean).map(hostPort),
    retries: Number(args.retries),
    backoff: [Number(backoff[1]), Number(backoff[2])],
  };
}

const opts = parseArgs(process.argv.slice(2));
if (opts.upstreams.length === 0) fail('--upstreams is required');

// The bug: a retry goes to the node that just failed.
function pick(previous) {
  if (previous) return previous;
  return opts.upstreams[Math.floor(Math.random() * opts.upstreams.length)];
}

function attempt(node, path, done) {
  const req = http.get({ host: node.host, port: node.port, path, agent: false, timeout: 2000 }, (res) => {
    const chunks = [];
    res.on('data', (c) => chunks.push(c));
    res.on('end', () => done(null, res, Buffer.concat(chunks)));
    res.on('error', (e) => done(e));
  });
  req.on('timeout', () => req.destroy(new Error('upstream timeout')));
  req.on('error', (e) => done(e));
}

function route(clientReq, clientRes) {
  let tries = 0;
  let node = null;
  const next = () => {
    node = pick(node);
    tries += 1;
    attempt(node, clientReq.url, (err, res, body) => {
      if (!err) {
        clientRes.writeHead(res.statusCode, { 'content-type': 'text/plain', 'x-upstream': `${node.host}:${node.port}` });
        clientRes.end(body);
        return;
      }
      if (tries > opts.retries) {
        clientRes.writeHead(502, { 'content-type': 'text/plain' });
        clientRes.end(`upstream ${node.host}:${node.port} failed ${tries} times: ${err.code || err.message}\n`);
        return;
      }
      const [min, max] = opts.backoff;
      setTimeout(next, min + Math.floor(Math.random() * (max - min + 1)));
    });
  };
  next();
}

const server = http.createServer((req, res) => {
  req.resume();
  route(req, res);
});
server.on('error', (e) => {
  process.stderr.write(`retry-gateway.js: ${e.message}\n`);
  process.exit(1);
});
server.listen(opts.listen.port, opts.listen.host, () => {
  process.stdout.write(`ready addr=${opts.listen.host}:${opts.listen.port}\n`);
});
