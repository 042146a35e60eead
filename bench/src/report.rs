//! Output: the terminal table, the `--json` file and the `--report` HTML page.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use plotters::prelude::*;

use super::PolicyRun;
use super::stats::Summary;

/// What the run was, for headers.
#[derive(Debug, Clone, PartialEq)]
pub struct RunInfo {
    pub mode: String,
    pub workload: String,
    pub cluster: String,
    pub command: String,
}

fn fmt_ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{:.1}", v)
    }
}

/// The comparison as a fixed-width table.
pub fn table(runs: &[PolicyRun]) -> String {
    let header = [
        "policy",
        "reqs",
        "err",
        "hit",
        "ceiling",
        "ttft p50",
        "p90",
        "p99",
        "e2e p50",
        "p99",
        "tpot p50",
        "p90",
        "out tok/s",
        "slo",
        "load cv",
        "prefill",
        "dec µs p99",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|s| (*s).to_string()).collect()];
    for r in runs {
        let s = &r.summary;
        rows.push(vec![
            s.policy.clone(),
            s.requests.to_string(),
            s.errors.to_string(),
            format!("{:.1}%", s.hit_rate * 100.0),
            format!("{:.1}%", s.hit_rate_ceiling * 100.0),
            fmt_ms(s.ttft_ms_p50),
            fmt_ms(s.ttft_ms_p90),
            fmt_ms(s.ttft_ms_p99),
            fmt_ms(s.e2e_ms_p50),
            fmt_ms(s.e2e_ms_p99),
            fmt_ms(s.tpot_ms_p50),
            fmt_ms(s.tpot_ms_p90),
            format!("{:.0}", s.output_tok_s),
            format!("{:.1}%", s.slo_attainment * 100.0),
            format!("{:.2}", s.load_cv),
            format!("{:.2}", s.prefill_util),
            s.decision_us_p99
                .map_or_else(|| "-".into(), |v| format!("{v:.1}")),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for (i, row) in rows.iter().enumerate() {
        for (c, cell) in row.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c == 0 {
                let _ = write!(out, "{cell}{}", " ".repeat(pad));
            } else {
                let _ = write!(out, "  {}{cell}", " ".repeat(pad));
            }
        }
        out.push('\n');
        if i == 0 {
            let total: usize = widths.iter().sum::<usize>() + 2 * (widths.len() - 1);
            out.push_str(&"-".repeat(total));
            out.push('\n');
        }
    }
    out
}

/// Notes printed under the table: references and errors.
pub fn notes(runs: &[PolicyRun]) -> String {
    let mut out = String::new();
    if let Some(ideal) = runs.iter().find_map(|r| r.detail.hit_rate_ideal) {
        let _ = writeln!(
            out,
            "hit-rate references: ceiling (infinite cache, one worker) {:.1}%, ideal router with \
             this capacity (pooled LRU estimate) {:.1}%",
            runs.first().map_or(0.0, |r| r.summary.hit_rate_ceiling) * 100.0,
            ideal * 100.0
        );
        // the ideal follows the order the requests were sent in, which a closed loop's policy
        // (and session admission) changes
        if runs
            .iter()
            .filter_map(|r| r.detail.hit_rate_ideal)
            .any(|i| (i - ideal).abs() > 0.001)
        {
            for r in runs {
                if let Some(i) = r.detail.hit_rate_ideal {
                    let _ = writeln!(
                        out,
                        "{}: ideal with this capacity in its own request order {:.1}%",
                        r.summary.policy,
                        i * 100.0
                    );
                }
            }
        }
    }
    for r in runs {
        let d = &r.detail;
        if !d.phases.is_empty() {
            out.push_str(&crate::scenario::text(
                &r.summary.policy,
                &d.phases,
                &d.recoveries,
            ));
        }
        if let Some(p) = &d.restarted_picker {
            let _ = writeln!(
                out,
                "  the restarted picker's first {} requests after it came back: hit {:.1}%; the \
                 other pickers' {} over the same span: {:.1}%",
                p.requests,
                p.hit_rate * 100.0,
                p.others_requests,
                p.others_hit_rate * 100.0
            );
        }
        if let Some(p) = &d.picker {
            let pct =
                |x: Option<f64>| x.map_or_else(|| "-".into(), |v| format!("{:.1}%", v * 100.0));
            let _ = writeln!(
                out,
                "{}: picker credited {} of prompt tokens as cached (engines hit {}); {} of {} \
                 decisions by session pin",
                r.summary.policy,
                pct(p.credited),
                pct(Some(r.summary.hit_rate)),
                pct(p.session_pinned),
                p.decisions
            );
            for (e, overhead, per_token, decode) in &p.learned {
                let _ = writeln!(
                    out,
                    "{}: cost model learned for {e}: {overhead:.1} ms a step + {per_token:.4} ms \
                     a prefill token, decode step {decode:.1} ms",
                    r.summary.policy
                );
            }
        }
        if let Some(a) = &d.admission {
            let _ = writeln!(
                out,
                "{}: admission held {} first turns ({} until maxWait), waits p50 {:.0} / p99 {:.0} / max {:.0} ms (in their TTFT); live context {:.2} (mean) / {:.2} (peak) of capacity × overcommit",
                r.summary.policy,
                a.held,
                a.timeouts,
                a.wait_ms_p50,
                a.wait_ms_p99,
                a.wait_ms_max,
                a.live_mean,
                a.live_peak
            );
        }
        for (class, requests, shed, p50, p90) in &d.classes {
            let _ = writeln!(
                out,
                "{}: {class}: {requests} requests, {shed} answered without service, TTFT p50 {p50:.0} / p90 {p90:.0} ms",
                r.summary.policy
            );
        }
        if let Some((requests, resident, loads)) = d.lora {
            let _ = writeln!(
                out,
                "{}: LoRA adapter already loaded for {:.1}% of {requests} requests ({loads} loads)",
                r.summary.policy,
                if requests > 0 {
                    resident as f64 * 100.0 / requests as f64
                } else {
                    0.0
                },
            );
        }
        if !d.engine_prompt_tokens.is_empty() {
            let most = d.engine_prompt_tokens.iter().copied().fold(0.0, f64::max);
            let least = d
                .engine_prompt_tokens
                .iter()
                .copied()
                .fold(f64::INFINITY, f64::min);
            let spread = if least > 0.0 {
                format!("{:.2}", most / least)
            } else {
                "unbounded".into()
            };
            let _ = writeln!(
                out,
                "{}: prompt tokens per engine: {} (most / least {spread})",
                r.summary.policy,
                in_thousands(&d.engine_prompt_tokens)
            );
        }
        if !d.engine_prefill_tokens.is_empty() {
            let _ = writeln!(
                out,
                "{}: tokens prefilled per engine: {}",
                r.summary.policy,
                in_thousands(&d.engine_prefill_tokens)
            );
        }
    }
    for r in runs {
        for e in &r.detail.error_samples {
            let _ = writeln!(out, "{}: error: {e}", r.summary.policy);
        }
    }
    out
}

/// Token counts in thousands, `12k / 30k / ...`.
fn in_thousands(tokens: &[f64]) -> String {
    tokens
        .iter()
        .map(|t| format!("{:.0}k", t / 1000.0))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// Write the summaries as a JSON array, one object per policy.
pub fn write_json(path: &Path, runs: &[PolicyRun]) -> anyhow::Result<()> {
    let all: Vec<&Summary> = runs.iter().map(|r| &r.summary).collect();
    let text = serde_json::to_string_pretty(&all)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    C[i % C.len()]
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing a plot: {e:?}")
}

/// Draw the legend at `position` and finish the drawing.
fn finish_chart<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    root: &DrawingArea<DB, plotters::coord::Shift>,
    position: SeriesLabelPosition,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)
}

fn ttft_cdf_svg(runs: &[PolicyRun]) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let max = runs
            .iter()
            .filter_map(|r| r.detail.ttfts_sorted.last().copied())
            .fold(10.0_f64, f64::max)
            * 1.2;
        let min = runs
            .iter()
            .filter_map(|r| r.detail.ttfts_sorted.first().copied())
            .fold(max, f64::min)
            .max(1.0)
            * 0.8;
        let mut chart = ChartBuilder::on(&root)
            .caption("TTFT CDF (simulated ms, log scale)", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(44)
            .build_cartesian_2d((min..max).log_scale(), 0.0..1.0)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .x_labels(8)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .x_desc("TTFT ms")
            .y_desc("fraction of requests")
            .draw()
            .map_err(plot_err)?;
        for (i, r) in runs.iter().enumerate() {
            let v = &r.detail.ttfts_sorted;
            if v.is_empty() {
                continue;
            }
            let n = v.len();
            let step = n.div_ceil(1000).max(1);
            let pts: Vec<(f64, f64)> = v
                .iter()
                .enumerate()
                .step_by(step)
                .chain(std::iter::once((n - 1, &v[n - 1])))
                .map(|(k, &x)| (x.max(min), (k + 1) as f64 / n as f64))
                .collect();
            let c = color(i);
            chart
                .draw_series(LineSeries::new(pts, c.stroke_width(2)))
                .map_err(plot_err)?
                .label(r.summary.policy.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
        }
        finish_chart(&mut chart, &root, SeriesLabelPosition::LowerRight)?;
    }
    Ok(svg)
}

fn hit_rate_svg(runs: &[PolicyRun]) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 360)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let n = runs.len().max(1);
        let mut chart = ChartBuilder::on(&root)
            .caption("prefix hit rate vs. ceiling", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(44)
            .build_cartesian_2d(0.0..n as f64, 0.0..1.0)
            .map_err(plot_err)?;
        let names: Vec<String> = runs.iter().map(|r| r.summary.policy.clone()).collect();
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .disable_x_mesh()
            .x_labels(n * 2 + 1)
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                if (x - x.floor() - 0.5).abs() < 0.01 {
                    names.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc("hit rate")
            .draw()
            .map_err(plot_err)?;
        chart
            .draw_series(runs.iter().enumerate().map(|(i, r)| {
                Rectangle::new(
                    [(i as f64 + 0.2, 0.0), (i as f64 + 0.8, r.summary.hit_rate)],
                    color(i).filled(),
                )
            }))
            .map_err(plot_err)?;
        if let Some(first) = runs.first() {
            let ceil = first.summary.hit_rate_ceiling;
            chart
                .draw_series(LineSeries::new(
                    vec![(0.0, ceil), (n as f64, ceil)],
                    BLACK.stroke_width(2),
                ))
                .map_err(plot_err)?
                .label(format!("ceiling {:.1}%", ceil * 100.0))
                .legend(|(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], BLACK.stroke_width(2))
                });
            if let Some(ideal) = first.detail.hit_rate_ideal {
                let c = RGBColor(120, 120, 120);
                chart
                    .draw_series(LineSeries::new(
                        vec![(0.0, ideal), (n as f64, ideal)],
                        c.stroke_width(1),
                    ))
                    .map_err(plot_err)?
                    .label(format!("ideal with capacity {:.1}%", ideal * 100.0))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(1))
                    });
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(plot_err)?;
        }
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

fn load_svg(run: &PolicyRun) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 300)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let series = &run.detail.load_series;
        let tmax = series
            .iter()
            .flat_map(|(_, s)| s.last().map(|p| p.0))
            .fold(1.0_f64, f64::max);
        let ymax = series
            .iter()
            .flat_map(|(_, s)| s.iter().map(|p| p.1))
            .fold(1.0_f64, f64::max)
            * 1.1;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "{}: requests per engine (waiting + running)",
                    run.summary.policy
                ),
                ("sans-serif", 16),
            )
            .margin(10)
            .x_label_area_size(32)
            .y_label_area_size(44)
            .build_cartesian_2d(0.0..tmax, 0.0..ymax)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .x_desc("simulated s")
            .draw()
            .map_err(plot_err)?;
        for (i, (_, s)) in series.iter().enumerate() {
            chart
                .draw_series(LineSeries::new(s.iter().copied(), color(i).stroke_width(1)))
                .map_err(plot_err)?;
        }
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The page's start: title, style and what was run.
fn html_head(info: &RunInfo) -> String {
    let mut html = String::new();
    let _ = write!(
        html,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>kvroute-bench report</title>\
         <style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}\
         pre{{background:#f6f6f6;padding:1em;overflow-x:auto}}\
         table{{border-collapse:collapse}}td,th{{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}}\
         td:first-child,th:first-child{{text-align:left}}</style></head><body>\
         <h1>kvroute-bench</h1><p><b>mode</b> {}<br><b>workload</b> {}<br><b>cluster</b> {}<br>\
         <b>command</b> <code>{}</code></p>",
        esc(&info.mode),
        esc(&info.workload),
        esc(&info.cluster),
        esc(&info.command)
    );
    html
}

/// The results as an HTML table (one row per policy).
fn results_table(runs: &[PolicyRun]) -> String {
    let mut html = String::from("<table><tr>");
    for h in [
        "policy",
        "requests",
        "errors",
        "hit rate",
        "ceiling",
        "TTFT p50",
        "p90",
        "p99",
        "e2e p50",
        "p99",
        "TPOT p50",
        "p90",
        "out tok/s",
        "SLO",
        "load CV",
        "prefill util",
        "decision µs p99",
    ] {
        let _ = write!(html, "<th>{h}</th>");
    }
    html.push_str("</tr>");
    for r in runs {
        let s = &r.summary;
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.1}%</td><td>{:.1}%</td><td>{:.0}</td>\
             <td>{:.0}</td><td>{:.0}</td><td>{:.0}</td><td>{:.0}</td><td>{:.1}</td><td>{:.1}</td>\
             <td>{:.0}</td><td>{:.1}%</td><td>{:.2}</td><td>{:.2}</td><td>{}</td></tr>",
            esc(&s.policy),
            s.requests,
            s.errors,
            s.hit_rate * 100.0,
            s.hit_rate_ceiling * 100.0,
            s.ttft_ms_p50,
            s.ttft_ms_p90,
            s.ttft_ms_p99,
            s.e2e_ms_p50,
            s.e2e_ms_p99,
            s.tpot_ms_p50,
            s.tpot_ms_p90,
            s.output_tok_s,
            s.slo_attainment * 100.0,
            s.load_cv,
            s.prefill_util,
            s.decision_us_p99
                .map_or_else(|| "-".into(), |v| format!("{v:.1}"))
        );
    }
    html.push_str("</table>");
    html
}

/// Write `index.html` (with inline SVG plots) and `results.json` into `dir`.
pub fn write_html(dir: &Path, info: &RunInfo, runs: &[PolicyRun]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut html = html_head(info);
    html.push_str("<h2>Results</h2>");
    html.push_str(&results_table(runs));
    html.push_str("<p>Times are simulated milliseconds.</p>");
    let _ = write!(html, "<pre>{}</pre>", esc(&notes(runs)));
    html.push_str("<h2>Time to first token</h2>");
    html.push_str(&ttft_cdf_svg(runs)?);
    html.push_str("<h2>Hit rate</h2>");
    html.push_str(&hit_rate_svg(runs)?);
    html.push_str("<h2>Load per engine over time</h2>");
    for r in runs {
        html.push_str(&load_svg(r)?);
    }
    html.push_str("</body></html>\n");
    let page = dir.join("index.html");
    std::fs::write(&page, html).with_context(|| format!("writing {}", page.display()))?;
    write_json(&dir.join("results.json"), runs)
}

/// One sweep chart: a figure of every policy's run against the concurrency, one line per
/// policy (and, for the hit rate, the pooled-LRU ideal at each point as a dashed line).
fn sweep_svg(
    points: &[(usize, Vec<PolicyRun>)],
    title: &str,
    y_desc: &str,
    figure: impl Fn(&PolicyRun) -> f64,
    ideal: bool,
) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 380)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let xs: Vec<f64> = points.iter().map(|(c, _)| *c as f64).collect();
        let (x0, x1) = (
            xs.iter().copied().fold(f64::INFINITY, f64::min).min(0.0),
            xs.iter().copied().fold(1.0, f64::max) * 1.05,
        );
        let mut ymax = points
            .iter()
            .flat_map(|(_, runs)| runs.iter().map(&figure))
            .fold(0.0_f64, f64::max);
        if ideal {
            ymax = ymax.max(1.0);
        }
        let ymax = if ymax > 0.0 { ymax * 1.1 } else { 1.0 };
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(x0..x1, 0.0..ymax)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .x_desc("sessions at once")
            .y_desc(y_desc)
            .draw()
            .map_err(plot_err)?;
        let names: Vec<String> = points
            .first()
            .map(|(_, runs)| runs.iter().map(|r| r.summary.policy.clone()).collect())
            .unwrap_or_default();
        for (i, name) in names.iter().enumerate() {
            let pts: Vec<(f64, f64)> = points
                .iter()
                .filter_map(|(c, runs)| {
                    runs.iter()
                        .find(|r| &r.summary.policy == name)
                        .map(|r| (*c as f64, figure(r)))
                })
                .collect();
            let c = color(i);
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(plot_err)?
                .label(name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, c.filled())))
                .map_err(plot_err)?;
        }
        if ideal {
            let pts: Vec<(f64, f64)> = points
                .iter()
                .filter_map(|(c, runs)| {
                    runs.iter()
                        .find_map(|r| r.detail.hit_rate_ideal)
                        .map(|v| (*c as f64, v))
                })
                .collect();
            let grey = RGBColor(120, 120, 120);
            chart
                .draw_series(DashedLineSeries::new(pts, 6, 4, grey.stroke_width(1)))
                .map_err(plot_err)?
                .label("ideal with this capacity (pooled LRU)")
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], grey.stroke_width(1))
                });
        }
        finish_chart(&mut chart, &root, SeriesLabelPosition::UpperRight)?;
    }
    Ok(svg)
}

/// Write an oversubscription sweep's `index.html` (hit rate, p90 TTFT and output throughput
/// against the concurrency, then each point's table) and `results.json` into `dir`.
pub fn write_sweep_html(
    dir: &Path,
    info: &RunInfo,
    points: &[(usize, Vec<PolicyRun>)],
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut html = html_head(info);
    html.push_str("<h2>Hit rate</h2>");
    html.push_str(&sweep_svg(
        points,
        "prefix hit rate against sessions at once",
        "hit rate",
        |r| r.summary.hit_rate,
        true,
    )?);
    html.push_str("<h2>p90 time to first token</h2>");
    html.push_str(&sweep_svg(
        points,
        "p90 TTFT against sessions at once (simulated ms)",
        "p90 TTFT ms",
        |r| r.summary.ttft_ms_p90,
        false,
    )?);
    html.push_str("<h2>Output throughput</h2>");
    html.push_str(&sweep_svg(
        points,
        "output tokens per second against sessions at once",
        "output tok/s",
        |r| r.summary.output_tok_s,
        false,
    )?);
    for (c, runs) in points {
        let _ = write!(html, "<h2>{c} sessions at once</h2>");
        html.push_str(&results_table(runs));
        let _ = write!(html, "<pre>{}</pre>", esc(&notes(runs)));
    }
    html.push_str("<p>Times are simulated milliseconds.</p></body></html>\n");
    let page = dir.join("index.html");
    std::fs::write(&page, html).with_context(|| format!("writing {}", page.display()))?;
    let all: Vec<PolicyRun> = points.iter().flat_map(|(_, r)| r.iter().cloned()).collect();
    write_json(&dir.join("results.json"), &all)
}
