// Validates PodMonitor and PrometheusRule manifests (the files given) against
// prometheus-operator's schemas from @kubernetes-models/prometheus-operator (types, enums,
// required fields). Those schemas, like the CRDs', allow unknown fields; so the keys of spec, of
// each podMetricsEndpoints entry, of each rule group and of each rule are also checked against
// the fields the models declare. Run by `cargo xtask test` from
// target/xtask-tools/npm, where the packages are installed.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { parseAllDocuments } from "yaml";
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";

const require = createRequire(import.meta.url);
const modelDir = join(
  dirname(require.resolve("@kubernetes-models/prometheus-operator/package.json")),
  "monitoring.coreos.com/v1",
);

// Top-level fields of the interface in a model's .d.ts (declared at four spaces of indent).
function declaredFields(model) {
  const text = readFileSync(join(modelDir, `${model}.d.ts`), "utf8");
  return new Set([...text.matchAll(/^ {4}"([A-Za-z0-9_]+)"\??:/gm)].map((m) => m[1]));
}

function unknownKeys(obj, allowed, where) {
  return Object.keys(obj ?? {})
    .filter((k) => !allowed.has(k))
    .map((k) => `${where}.${k}: unknown field`);
}

const specFields = declaredFields("PodMonitorSpec");
const endpointFields = declaredFields("PodMetricsEndpoint");
const ruleSpecFields = declaredFields("PrometheusRuleSpec");
const groupFields = declaredFields("RuleGroup");
const ruleFields = declaredFields("Rule");

function podMonitorErrors(obj) {
  const errors = unknownKeys(obj.spec, specFields, "spec");
  (obj.spec?.podMetricsEndpoints ?? []).forEach((e, i) => {
    errors.push(...unknownKeys(e, endpointFields, `spec.podMetricsEndpoints[${i}]`));
  });
  try {
    new PodMonitor(obj).validate();
  } catch (e) {
    errors.push(e.message);
  }
  return errors;
}

function prometheusRuleErrors(obj) {
  const errors = unknownKeys(obj.spec, ruleSpecFields, "spec");
  const groups = obj.spec?.groups ?? [];
  if (!groups.length) errors.push("spec.groups: no rule group");
  groups.forEach((g, i) => {
    errors.push(...unknownKeys(g, groupFields, `spec.groups[${i}]`));
    (g.rules ?? []).forEach((r, j) => {
      errors.push(...unknownKeys(r, ruleFields, `spec.groups[${i}].rules[${j}]`));
    });
  });
  try {
    new PrometheusRule(obj).validate();
  } catch (e) {
    errors.push(e.message);
  }
  return errors;
}
let failed = 0;
for (const file of process.argv.slice(2)) {
  for (const doc of parseAllDocuments(readFileSync(file, "utf8"))) {
    if (doc.errors.length) {
      console.error(`${file}: ${doc.errors.map(String).join("; ")}`);
      failed++;
      continue;
    }
    const obj = doc.toJS();
    const check = { PodMonitor: podMonitorErrors, PrometheusRule: prometheusRuleErrors }[obj?.kind];
    if (!check) continue;
    const errors = check(obj);
    if (errors.length) {
      console.error(`${file}: ${obj.kind} ${obj.metadata?.name}: ${errors.join("; ")}`);
      failed++;
    } else {
      console.log(`${file}: ${obj.kind} ${obj.metadata?.name} valid`);
    }
  }
}
process.exit(failed ? 1 : 0);
