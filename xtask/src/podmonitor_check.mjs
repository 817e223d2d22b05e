// Validates PodMonitor manifests (the files given) against prometheus-operator's schema from
// @kubernetes-models/prometheus-operator (types, enums, required fields). That schema, like the
// CRD's, allows unknown fields; so the keys of spec and of each podMetricsEndpoints entry are
// also checked against the fields the model declares. Run by `cargo xtask test` from
// target/xtask-tools/npm, where the packages are installed.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { parseAllDocuments } from "yaml";
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";

const require = createRequire(import.meta.url);
const modelDir = join(
  dirname(require.resolve("@kubernetes-models/prometheus-operator/package.json")),
  "monitoring.coreos.com/v1",
);

// Top-level fields of the interface in a model's .d.ts (declared at four spaces of indent).
function declaredFields(model) {
  const text = readFileSync(join(modelDir, `${model}.d.ts`), "utf8");
  return new Set([...text.matchAll(/^ {4}"([A-Za-z0-9]+)"\??:/gm)].map((m) => m[1]));
}

function unknownKeys(obj, allowed, where) {
  return Object.keys(obj ?? {})
    .filter((k) => !allowed.has(k))
    .map((k) => `${where}.${k}: unknown field`);
}

const specFields = declaredFields("PodMonitorSpec");
const endpointFields = declaredFields("PodMetricsEndpoint");
let failed = 0;
for (const file of process.argv.slice(2)) {
  for (const doc of parseAllDocuments(readFileSync(file, "utf8"))) {
    if (doc.errors.length) {
      console.error(`${file}: ${doc.errors.map(String).join("; ")}`);
      failed++;
      continue;
    }
    const obj = doc.toJS();
    if (!obj || obj.kind !== "PodMonitor") continue;
    const errors = unknownKeys(obj.spec, specFields, "spec");
    (obj.spec?.podMetricsEndpoints ?? []).forEach((e, i) => {
      errors.push(...unknownKeys(e, endpointFields, `spec.podMetricsEndpoints[${i}]`));
    });
    try {
      new PodMonitor(obj).validate();
    } catch (e) {
      errors.push(e.message);
    }
    if (errors.length) {
      console.error(`${file}: PodMonitor ${obj.metadata?.name}: ${errors.join("; ")}`);
      failed++;
    } else {
      console.log(`${file}: PodMonitor ${obj.metadata?.name} valid`);
    }
  }
}
process.exit(failed ? 1 : 0);
