#!/usr/bin/env node
// upstream-node.js: one upstream node of a service behind an API gateway, on Node.js (comm
// `node`), standard library only.
//
//   node upstream-node.js --listen HOST:PORT --name NAME [--mode ok|reset] [--reset-every N]
//
// --mode ok (default): an HTTP server answering every request 200 `served by NAME`
//   (closing the connection when the client asks for Connection: close).
// --mode reset: a broken node that accepts every connection and resets it at once (RST),
//   before reading anything.
// --reset-every N: with --mode ok, every Nth connection is reset at accept (a healthy node
//   that sees the occasional reset).
//
// A node that refuses connections needs no program: nothing listens on its port.
//
// Prints `ready name=NAME addr=HOST:PORT` on stdout once listening.
'use strict';

const http = require('http');
const net = require('net');

const USAGE = 'usage: node upstream-node.js --listen HOST:PORT --name NAME [--mode ok|reset] [--reset-every N]';

function fail(msg) {
  process.stderr.write(`upstream-node.js: ${msg}\n${USAGE}\n`);
  process.exit(2);
}

function parseArgs(argv) {
  const args = { listen: null, name: null, mode: 'ok', 'reset-every': '0' };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const key = flag.replace(/^--/, '');
    if (!(key in args) || flag === key) fail(`unknown option ${flag}`);
    args[key] = argv[++i];
  }
  const m = /^([^:]+):(\d+)$/.exec(args.listen || '');
  if (!m) fail(`--listen needs HOST:PORT, got ${JSON.stringify(args.listen)}`);
  if (!args.name) fail('--name is required');
  if (args.mode !== 'ok' && args.mode !== 'reset') fail(`--mode ok|reset, got ${args.mode}`);
  const every = Number(args['reset-every']);
  if (!Number.isInteger(every) || every < 0) fail('--reset-every needs a count');
  return { host: m[1], port: Number(m[2]), name: args.name, mode: args.mode, every };
}

const opts = parseArgs(process.argv.slice(2));
let accepted = 0;

function resetsThis() {
  accepted += 1;
  return opts.mode === 'reset' || (opts.every > 0 && accepted % opts.every === 0);
}

let server;
if (opts.mode === 'reset') {
  server = net.createServer((socket) => {
    resetsThis();
    socket.resetAndDestroy();
  });
} else {
  server = http.createServer((req, res) => {
    req.resume();
    req.on('end', () => {
      res.writeHead(200, { 'content-type': 'text/plain', 'x-upstream': opts.name });
      res.end(`served by ${opts.name}\n`);
    });
  });
  server.on('connection', (socket) => {
    if (resetsThis()) socket.resetAndDestroy();
  });
}
server.on('error', (e) => {
  process.stderr.write(`upstream-node.js: ${e.message}\n`);
  process.exit(1);
});
server.listen(opts.port, opts.host, () => {
  process.stdout.write(`ready name=${opts.name} addr=${opts.host}:${opts.port}\n`);
});
