//! The self-contained HTML reports of `ragctl eval retrieval` and `ragctl eval answers` (the
//! summary table, a grouped bar chart of every metric across configurations, the per-query
//! distribution of one metric (nDCG@10, token F1) for each configuration, and latency) and of `ragctl optimize` (every trial, one score chart
//! per node with its winner, score against latency). Charts are SVG drawn with plotters (SVG
//! backend only: no system font or image libraries) and inlined, so the file opens anywhere
//! offline.

use std::collections::BTreeMap;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

/// One evaluated configuration: mean metrics, per-query values of each metric, latency.
pub struct Config {
    pub name: String,
    pub means: BTreeMap<String, f64>,
    pub per_query: BTreeMap<String, Vec<f64>>,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("chart: {e}")
}

/// The series legend, boxed on a translucent background.
fn legend<'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
    at: SeriesLabelPosition,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

/// The category whose bar group is centred at `x` (category i spans [i, i + 1)): bar charts
/// label only their centres.
fn centre(x: f64) -> Option<usize> {
    let i = x.floor() as usize;
    ((x - i as f64 - 0.5).abs() < 0.01).then_some(i)
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

/// Metrics on the x axis, one bar per configuration in each group.
fn metric_bars(configs: &[Config], metrics: &[String]) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let n = metrics.len().max(1);
        let mut chart = ChartBuilder::on(&root)
            .caption("Mean metrics by configuration", ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..n as f64, 0f64..1.3)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_labels(n * 2 + 1)
            .x_label_formatter(&|x| {
                centre(*x)
                    .and_then(|i| metrics.get(i).cloned())
                    .unwrap_or_default()
            })
            .disable_x_mesh()
            .y_desc("mean over queries")
            .draw()
            .map_err(err)?;
        let w = 0.8 / configs.len().max(1) as f64;
        for (j, c) in configs.iter().enumerate() {
            let col = color(j);
            chart
                .draw_series(metrics.iter().enumerate().map(|(i, m)| {
                    let x0 = i as f64 + 0.1 + j as f64 * w;
                    let v = c.means.get(m).copied().unwrap_or(0.0);
                    Rectangle::new([(x0, 0.0), (x0 + w * 0.95, v)], col.filled())
                }))
                .map_err(err)?
                .label(c.name.clone())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], col.filled()));
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Share of queries per 0.1-wide bin of a per-query metric, one line per configuration.
fn distribution(configs: &[Config], metric: &str) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 360)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("Per-query {metric} distribution"),
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..1.0, 0f64..1.0)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(metric)
            .y_desc("share of queries")
            .draw()
            .map_err(err)?;
        for (j, c) in configs.iter().enumerate() {
            let v = c.per_query.get(metric).cloned().unwrap_or_default();
            let mut bins = [0usize; 10];
            for x in &v {
                bins[((x * 10.0).floor() as usize).min(9)] += 1;
            }
            let total = v.len().max(1) as f64;
            let col = color(j);
            chart
                .draw_series(LineSeries::new(
                    bins.iter()
                        .enumerate()
                        .map(|(i, &b)| (i as f64 / 10.0 + 0.05, b as f64 / total)),
                    col.stroke_width(2),
                ))
                .map_err(err)?
                .label(c.name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 14, y)], col.stroke_width(2))
                });
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The whole report as one HTML document.
/// `per_query` names the metric whose per-query distribution is drawn.
pub fn html(
    title: &str,
    configs: &[Config],
    metrics: &[String],
    per_query: &str,
) -> Result<String> {
    let mut rows = String::new();
    for c in configs {
        rows.push_str(&format!("<tr><td>{}</td>", esc(&c.name)));
        for m in metrics {
            rows.push_str(&format!(
                "<td>{:.4}</td>",
                c.means.get(m).copied().unwrap_or(0.0)
            ));
        }
        rows.push_str(&format!(
            "<td>{:.1}</td><td>{:.1}</td></tr>\n",
            c.p50_ms, c.p99_ms
        ));
    }
    let head: String = metrics
        .iter()
        .map(|m| format!("<th>{}</th>", esc(m)))
        .collect();
    Ok(format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title>\n<style>body{{font-family:sans-serif;margin:2em}}\
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child{{text-align:left}}</style>\
</head><body>\n<h1>{t}</h1>\n<table><tr><th>configuration</th>{head}<th>p50 ms</th><th>p99 ms</th></tr>\n{rows}</table>\n\
<h2>Metrics</h2>\n{bars}\n<h2>Per-query distribution</h2>\n{dist}\n</body></html>\n",
        t = esc(title),
        bars = metric_bars(configs, metrics)?,
        dist = distribution(configs, per_query)?,
    ))
}

/// One trial of `ragctl optimize`, as the report shows it.
pub struct TrialRow {
    pub node: String,
    pub candidate: String,
    /// The node's strategy metrics, as text.
    pub metrics: String,
    pub score: f64,
    pub p50_ms: f64,
    pub allowed: bool,
    pub won: bool,
}

const WON: RGBColor = RGBColor(44, 160, 44);
const SLOW: RGBColor = RGBColor(190, 190, 190);

/// The scores of one node's candidates (numbered as in the table), the winner in green and
/// candidates over the latency limit in grey.
fn node_scores(node: &str, rows: &[(usize, &TrialRow)]) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 300)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let n = rows.len().max(1);
        let top = rows.iter().map(|(_, r)| r.score).fold(0.0, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("node {node}: score by candidate"),
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..n as f64, 0f64..(top * 1.15).max(0.01))
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_labels(n * 2 + 1)
            .x_label_formatter(&|x| {
                centre(*x)
                    .and_then(|i| rows.get(i))
                    .map_or(String::new(), |(k, _)| format!("#{k}"))
            })
            .disable_x_mesh()
            .y_desc("score")
            .draw()
            .map_err(err)?;
        chart
            .draw_series(rows.iter().enumerate().map(|(i, (_, r))| {
                let c = if r.won {
                    WON
                } else if !r.allowed {
                    SLOW
                } else {
                    color(0)
                };
                Rectangle::new(
                    [(i as f64 + 0.15, 0.0), (i as f64 + 0.85, r.score)],
                    c.filled(),
                )
            }))
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Score against p50 latency (log scale) for every trial, one colour per node.
fn score_latency(nodes: &[String], rows: &[TrialRow]) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let lo = rows
            .iter()
            .map(|r| r.p50_ms)
            .fold(f64::MAX, f64::min)
            .max(0.01);
        let hi = rows
            .iter()
            .map(|r| r.p50_ms)
            .fold(0.0, f64::max)
            .max(lo * 10.0);
        let top = rows.iter().map(|r| r.score).fold(0.0, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption("Score against latency", ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(
                (lo * 0.8..hi * 1.25).log_scale(),
                0f64..(top * 1.15).max(0.01),
            )
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("p50 ms per question (log)")
            .y_desc("score")
            .draw()
            .map_err(err)?;
        for (j, node) in nodes.iter().enumerate() {
            let col = color(j);
            chart
                .draw_series(rows.iter().filter(|r| &r.node == node).map(|r| {
                    let size = if r.won { 7 } else { 4 };
                    Circle::new((r.p50_ms.max(lo), r.score), size, col.filled())
                }))
                .map_err(err)?
                .label(node.clone())
                .legend(move |(x, y)| Circle::new((x + 5, y), 4, col.filled()));
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// The optimiser's report: winner, every trial, per-node charts, score against latency.
pub fn optimizer_html(title: &str, winner: &str, trials: &[TrialRow]) -> Result<String> {
    let mut nodes: Vec<String> = Vec::new();
    for t in trials {
        if !nodes.contains(&t.node) {
            nodes.push(t.node.clone());
        }
    }
    let mut table = String::new();
    for (i, t) in trials.iter().enumerate() {
        table.push_str(&format!(
            "<tr{}><td>#{}</td><td>{}</td><td><code>{}</code></td><td>{:.4}</td><td>{}</td><td>{:.1}</td><td>{}</td></tr>\n",
            if t.won { " class=\"won\"" } else { "" },
            i + 1,
            esc(&t.node),
            esc(&t.candidate),
            t.score,
            esc(&t.metrics),
            t.p50_ms,
            if t.won {
                "winner"
            } else if !t.allowed {
                "over the latency limit"
            } else {
                ""
            },
        ));
    }
    let mut charts = String::new();
    for node in &nodes {
        let rows: Vec<(usize, &TrialRow)> = trials
            .iter()
            .enumerate()
            .filter(|(_, t)| &t.node == node)
            .map(|(i, t)| (i + 1, t))
            .collect();
        charts.push_str(&node_scores(node, &rows)?);
        charts.push('\n');
    }
    Ok(format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title>\n<style>body{{font-family:sans-serif;margin:2em}}\
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}tr.won{{background:#e6f4e6}}</style>\
</head><body>\n<h1>{t}</h1>\n<p>Winner: <code>{w}</code></p>\n<h2>Trials</h2>\n<table><tr><th></th><th>node</th><th>candidate</th>\
<th>score</th><th>metrics</th><th>p50 ms</th><th></th></tr>\n{table}</table>\n<h2>Scores by node</h2>\n{charts}\
<h2>Score against latency</h2>\n{lat}\n</body></html>\n",
        t = esc(title),
        w = esc(winner),
        lat = score_latency(&nodes, trials)?,
    ))
}
