//! The Helm chart's copy of the CRD (`charts/kvroute/templates/crds/kvroutepool.yaml`) is the
//! generated CRD wrapped in the chart's template guards.
//!
//! Helm installs files in a chart's `crds/` folder once and never upgrades them, so the chart
//! ships the CRD as a template instead: `helm upgrade` then updates it like any other object.

use std::path::PathBuf;

/// The chart's CRD template, relative to the workspace root.
const CHART_CRD: &str = "charts/kvroute/templates/crds/kvroutepool.yaml";

fn chart_crd_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(CHART_CRD)
}

/// The chart template made from the generated CRD: behind `crds.install`, with the chart's
/// labels, and kept on uninstall when `crds.keep` (deleting the CRD would delete every pool).
fn chart_template(generated: &str) -> String {
    const METADATA: &str = "\nmetadata:\n  name: kvroutepools.kvroute.dev\n";
    let body = generated
        .split_once("\n---\n")
        .map_or(generated, |(_header, body)| body);
    assert!(
        body.contains(METADATA),
        "the generated CRD no longer has the metadata block this test rewrites: update chart_template"
    );
    // text Go templates would read as an action
    let body = body.replace("{{", "{{ \"{{\" }}");
    let body = body.replacen(
        METADATA,
        concat!(
            "\nmetadata:\n",
            "  name: kvroutepools.kvroute.dev\n",
            "  labels:\n",
            "    {{- include \"kvroute.labels\" . | nindent 4 }}\n",
            "  {{- if .Values.crds.keep }}\n",
            "  annotations:\n",
            "    helm.sh/resource-policy: keep\n",
            "  {{- end }}\n",
        ),
        1,
    );
    format!(
        "{{{{- if .Values.crds.install }}}}\n\
         # Generated from crds/kvroutepool.yaml by crds/tests/helm_chart_crd.rs; do not edit.\n\
         # Regenerate: KVROUTE_UPDATE_CRDS=1 cargo test -p kvroute-crds\n\
         {body}\
         {{{{- end }}}}\n"
    )
}

#[test]
fn chart_crd_matches_the_generated_one() {
    let generated = kvroute_crds::crd_yaml().expect("render CRD");
    let expected = chart_template(&generated);
    let path = chart_crd_path();
    if std::env::var_os("KVROUTE_UPDATE_CRDS").is_some() {
        std::fs::write(&path, &expected).expect("write the chart's CRD template");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == expected,
        "{} is out of date with the generated CRD: run `KVROUTE_UPDATE_CRDS=1 cargo test -p kvroute-crds` and commit it",
        path.display()
    );
}

#[test]
fn chart_template_only_wraps_the_crd() {
    let generated = kvroute_crds::crd_yaml().expect("render CRD");
    let chart = chart_template(&generated);
    let (_, body) = generated.split_once("\n---\n").expect("header and body");
    // every line of the CRD is in the template, in order
    let mut lines = chart.lines();
    for line in body.lines() {
        assert!(
            lines.any(|l| l == line),
            "line missing from the chart copy: {line}"
        );
    }
    assert!(chart.starts_with("{{- if .Values.crds.install }}\n"));
    assert!(chart.ends_with("{{- end }}\n"));
}
