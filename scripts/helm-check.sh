#!/usr/bin/env bash
# Checks the Helm chart without a cluster: `helm lint --strict`, `helm template` with the
# default values and with the value sets the docs promise, and that values.schema.json (or the
# chart's own checks) reject bad values.
#
#   HELM=/path/to/helm scripts/helm-check.sh     # default: helm on PATH
set -euo pipefail

cd "$(dirname "$0")/.."
HELM="${HELM:-helm}"
CHART=charts/kvroute
NS=kvroute-system
# `helm template` renders for this Kubernetes version (a helm built with plain `go install`
# assumes v1.20, older than the chart's kubeVersion)
KUBE_VERSION="${KUBE_VERSION:-1.36.0}"

if ! command -v "$HELM" >/dev/null 2>&1; then
    echo "helm-check: no helm binary at '$HELM' (set HELM=/path/to/helm)" >&2
    exit 2
fi
echo "helm-check: $("$HELM" version --short) on $CHART"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
failures=0

fail() {
    echo "FAIL: $*" >&2
    failures=$((failures + 1))
}

# every object carries the standard labels in metadata.labels
standard_labels() {
    awk -v file="$1" '
        function check() {
            if (kind == "") return
            n = split("helm.sh/chart app.kubernetes.io/name app.kubernetes.io/instance app.kubernetes.io/version app.kubernetes.io/managed-by", want, " ")
            for (i = 1; i <= n; i++) if (!(want[i] in have)) { printf "%s %s %s: no label %s\n", file, kind, name, want[i]; bad = 1 }
        }
        /^---/ { check(); kind = ""; name = ""; delete have; meta = 0; labels = 0; next }
        /^kind: / { kind = $2 }
        /^metadata:$/ { meta = 1; next }
        /^[^ #]/ { meta = 0; labels = 0 }
        meta && /^  name: / && name == "" { name = $2 }
        meta && /^  labels:$/ { labels = 1; next }
        meta && /^  [^ ]/ { labels = 0 }
        labels && /^    [^ ]/ { key = $1; sub(/:$/, "", key); have[key] = 1 }
        END { check(); exit bad }
    ' "$out/$1.yaml" || fail "$1: objects without the standard labels"
}

# render NAME [helm args...]: renders into $out/NAME.yaml, fails on a render error
render() {
    local name=$1
    shift
    if "$HELM" template kvroute "$CHART" --namespace "$NS" --kube-version "$KUBE_VERSION" "$@" >"$out/$name.yaml" 2>"$out/$name.err"; then
        echo "ok: template $name"
        standard_labels "$name"
    else
        fail "template $name: $(cat "$out/$name.err")"
    fi
}

# expect NAME PATTERN: the rendering NAME contains a line matching PATTERN (grep -E)
expect() {
    grep -Eq -- "$2" "$out/$1.yaml" || fail "template $1: no line matches '$2'"
}

# refute NAME PATTERN: the rendering NAME contains no line matching PATTERN
refute() {
    if grep -Eq -- "$2" "$out/$1.yaml"; then fail "template $1: a line matches '$2'"; fi
}

# reject NAME MESSAGE_PATTERN [helm args...]: rendering must fail, with an error matching
# MESSAGE_PATTERN
reject() {
    local name=$1 pattern=$2
    shift 2
    if "$HELM" template kvroute "$CHART" --namespace "$NS" --kube-version "$KUBE_VERSION" "$@" >/dev/null 2>"$out/$name.err"; then
        fail "bad values accepted: $name ($*)"
    elif ! grep -Eq -- "$pattern" "$out/$name.err"; then
        fail "bad values $name rejected with an unexpected message: $(cat "$out/$name.err")"
    else
        echo "ok: rejects $name"
    fi
}

# lint, with the default values and with a non-default set
"$HELM" lint --strict "$CHART" --namespace "$NS" || fail "helm lint --strict"
"$HELM" lint --strict "$CHART" --namespace "$NS" \
    --set operator.watchNamespace=team-a --set rbac.pickerClusterRole=true \
    --set metrics.serviceMonitor.enabled=true || fail "helm lint --strict (non-default values)"

# defaults: CRD (as a template, kept), operator with leader election, cluster-wide RBAC
render default
expect default '^kind: CustomResourceDefinition$'
expect default 'name: kvroutepools\.kvroute\.dev'
expect default 'helm\.sh/resource-policy: keep'
expect default '^kind: ClusterRole$'
expect default '^kind: ClusterRoleBinding$'
expect default 'name: kvroute-operator-leader-election'
expect default 'replicas: 2$'
expect default 'image: "ghcr\.io/kvroute/kvroute:0\.1\.0"'
expect default '--picker-image=ghcr\.io/kvroute/kvroute:0\.1\.0$'
expect default '--lease-name=kvroute-operator$'
expect default 'readOnlyRootFilesystem: true'
expect default 'namespace: kvroute-system'
refute default '--no-leader-election'
refute default '--watch-namespace'
refute default '^kind: ServiceMonitor$'


# the chart's copy of the CRD is the committed CRD (crds/tests/helm_chart_crd.rs keeps the
# template in sync; this checks the rendering)
crd_spec() { sed -n '/^spec:$/,$p' "$1" | sed '/^---$/,$d'; }
crd_spec crds/kvroutepool.yaml >"$out/crd.committed"
awk '/^kind: CustomResourceDefinition$/{f=1} f&&/^---$/{exit} f' "$out/default.yaml" \
    | sed -n '/^spec:$/,$p' >"$out/crd.rendered"
cmp -s "$out/crd.committed" "$out/crd.rendered" \
    || fail "the rendered CRD's spec differs from crds/kvroutepool.yaml"

# the operator's peer-key seed: generated (and kept) by default, mounted, granted Secrets by name
expect default 'name: kvroute-operator-peer-seed$'
expect default '--peer-key-seed-file=/var/run/secrets/kvroute/peer-seed/seed$'
expect default 'resources: \["secrets"\]'
# a Secret of the user's: none generated, theirs mounted
render own-seed --set operator.peerKeySeedSecret=my-seed
refute own-seed '^kind: Secret$'
expect own-seed 'secretName: my-seed$'

render no-rbac --set rbac.create=false
refute no-rbac '^kind: (Cluster)?Role(Binding)?$'
expect no-rbac '^kind: ServiceAccount$'

render watch-namespace --set operator.watchNamespace=team-a
expect watch-namespace '--watch-namespace=team-a$'
expect watch-namespace '^kind: Role$'
expect watch-namespace 'namespace: team-a'
refute watch-namespace '^kind: ClusterRole$'

render no-operator --set operator.replicas=0
expect no-operator 'replicas: 0$'
expect no-operator '^kind: ServiceAccount$'
expect no-operator '^kind: ClusterRole$'

render single --set operator.replicas=1 --set operator.leaderElection.enabled=false
expect single '--no-leader-election'
refute single 'name: .*-leader-election'

render external-sa --set serviceAccount.create=false --set serviceAccount.name=my-operator
refute external-sa '^kind: ServiceAccount$'
expect external-sa 'serviceAccountName: my-operator'

render no-crds --set crds.install=false
refute no-crds '^kind: CustomResourceDefinition$'

render extras --set rbac.pickerClusterRole=true --set metrics.serviceMonitor.enabled=true \
    --set image.tag=dev --set operator.pickerImage=registry.local/picker:1 \
    --set-json 'operator.tolerations=[{"key":"dedicated","operator":"Equal","value":"ops","effect":"NoSchedule"}]'
expect extras '^kind: ServiceMonitor$'
expect extras 'name: kvroute-picker$'
expect extras 'image: "ghcr\.io/kvroute/kvroute:dev"'
expect extras '--picker-image=registry\.local/picker:1$'
# the pickers' default resources (the sizing rule), passed as JSON; null drops them
expect default '"--picker-resources=\{\\"limits\\":\{\\"memory\\":\\"3Gi\\"\},\\"requests\\":\{\\"cpu\\":\\"1\\",\\"memory\\":\\"1Gi\\"\}\}"$'
render no-picker-resources --set-json 'operator.pickerResources=null'
refute no-picker-resources 'picker-resources'

render keda --set-json 'autoscaling.scaledObjects=[{"name":"llama-servers","namespace":"serving","deployment":"llama-vllm","modelConfig":"llama","prometheusAddress":"http://prometheus.monitoring:9090","maxReplicas":16}]'
expect keda '^kind: ScaledObject$'
expect keda 'namespace: serving$'
expect keda 'maxReplicaCount: 16$'
expect keda 'minReplicaCount: 1$'
expect keda 'metricType: Value$'
expect keda 'query: "max\(kvroute_picker_pool_saturation\{model_config=\\"llama\\", namespace=\\"serving\\"\}\)"$'
expect keda 'threshold: "0\.8"$'
refute default '^kind: ScaledObject$'

# the Grafana dashboard's ConfigMap for the sidecar, and the pickers' PodMonitor
render dashboards --set grafana.dashboards.enabled=true --set metrics.pickerPodMonitor.enabled=true \
    --set grafana.dashboards.namespace=monitoring --set grafana.dashboards.annotations.grafana_folder=kvroute
expect dashboards '^kind: ConfigMap$'
expect dashboards '^    grafana_dashboard: "1"$'
expect dashboards '^  namespace: monitoring$'
expect dashboards '^    grafana_folder: kvroute$'
expect dashboards '^  kvroute-picker\.json: \|-$'
expect dashboards '"uid": "kvroute-picker"'
expect dashboards '^kind: PodMonitor$'
expect dashboards 'honorLabels: true$'
refute default '^kind: PodMonitor$'
refute default 'grafana_dashboard'

# bad values: the schema, or the chart's relational checks, reject them
reject dashboard-label 'label' --set grafana.dashboards.enabled=true --set grafana.dashboards.label='bad label'
reject unknown-key 'additional propert|not allowed' --set operator.replicaz=2
reject bad-seed-secret 'peerKeySeedSecret|pattern' --set operator.peerKeySeedSecret=Not_A_Name
reject unknown-top-level-key 'additional propert|not allowed' --set watchNamespace=team-a
reject negative-replicas 'minimum|must be >=' --set operator.replicas=-1
reject replicas-type 'integer|number|type' --set-string operator.replicas=two
reject pull-policy 'enum|must be one of|value must be' --set image.pullPolicy=Sometimes
reject port-range 'maximum|must be <=' --set operator.metricsPort=70000
reject bad-namespace 'pattern|does not match|anyOf' --set operator.watchNamespace=Team_A
reject resource-key 'additional propert|not allowed' --set operator.resources.requests.gpu=1
reject replicas-without-election 'leaderElection' --set operator.leaderElection.enabled=false
reject lease-grace 'leaseGrace' --set operator.leaderElection.leaseGrace=20
reject keda-missing-field 'required|missing' --set-json 'autoscaling.scaledObjects=[{"name":"a","namespace":"b","deployment":"c","modelConfig":"d"}]'
reject keda-min-above-max 'minReplicas' --set-json 'autoscaling.scaledObjects=[{"name":"a","namespace":"b","deployment":"c","modelConfig":"d","prometheusAddress":"http://p:9090","minReplicas":9,"maxReplicas":2}]'

if [ "$failures" -ne 0 ]; then
    echo "helm-check: $failures failure(s)" >&2
    exit 1
fi
echo "helm-check: all checks passed"
