//! The bandwidth plot as a self-contained SVG: GB/s (log scale) against transfer size (log
//! scale), one line per path, a legend beside the plot. Written by hand: no plotting dependency.

use std::fmt::Write as _;

use super::report::{short_size, Report};

/// Matplotlib's "tab10" palette: distinct on white, and for most colour-blind readers.
const PALETTE: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

const WIDTH: f64 = 1060.0;
const LEFT: f64 = 80.0;
const TOP: f64 = 64.0;
const PLOT_W: f64 = 660.0;
const PLOT_H: f64 = 460.0;
const BOTTOM: f64 = 64.0;
const LEGEND_X: f64 = LEFT + PLOT_W + 28.0;
const LEGEND_ROW: f64 = 17.0;

/// `s` escaped for SVG text and attribute values.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// How a path's line looks: colour, dash pattern (`None`: solid), square markers or round.
struct Style {
    color: &'static str,
    dash: Option<&'static str>,
    square: bool,
}

/// Raw paths get solid lines and round markers, store paths dashed lines and square markers;
/// the colours cycle within each group, with a dotted line once a group has used them all.
fn styles(paths: &[&str]) -> Vec<Style> {
    let (mut raw, mut store) = (0usize, 0usize);
    paths
        .iter()
        .map(|p| {
            let is_store = p.starts_with("store_");
            let i = if is_store { &mut store } else { &mut raw };
            let k = *i;
            *i += 1;
            let dash = match (is_store, k / PALETTE.len()) {
                (false, 0) => None,
                (true, 0) => Some("7 4"),
                (false, _) => Some("2 3"),
                (true, _) => Some("7 3 2 3"),
            };
            Style { color: PALETTE[k % PALETTE.len()], dash, square: is_store }
        })
        .collect()
}

/// The SVG plot of a report: bandwidth against size, one line per measured path.
pub fn svg_plot(report: &Report) -> String {
    let paths = report.measured_paths();
    let styles = styles(&paths);
    let legend_h = paths.len() as f64 * LEGEND_ROW + 30.0;
    let height = (TOP + PLOT_H + BOTTOM).max(TOP + legend_h + 20.0);

    // Axis ranges (log2 of bytes, log10 of GB/s), padded so that no marker sits on an axis.
    let sizes: Vec<f64> = report.sizes.iter().map(|&b| (b.max(1) as f64).log2()).collect();
    let (mut x0, mut x1) =
        sizes.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    if !x0.is_finite() {
        (x0, x1) = (12.0, 30.0);
    }
    if x1 - x0 < 1.0 {
        x0 -= 1.0;
        x1 += 1.0;
    }
    let pad = (x1 - x0) * 0.04;
    let (x0p, x1p) = (x0 - pad, x1 + pad);
    let gbps: Vec<f64> =
        report.results.iter().map(|m| m.gbps).filter(|g| g.is_finite() && *g > 0.0).collect();
    let lo = gbps.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = gbps.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (mut y0, mut y1) =
        if lo.is_finite() { (lo.log10().floor(), hi.log10().ceil()) } else { (-1.0, 3.0) };
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    if y1 - y0 > 12.0 {
        y0 = y1 - 12.0;
    }
    let px = |lx: f64| LEFT + (lx - x0p) / (x1p - x0p) * PLOT_W;
    let py = |ly: f64| TOP + PLOT_H - (ly - y0) / (y1 - y0) * PLOT_H;

    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         viewBox=\"0 0 {WIDTH} {height}\" font-family=\"Helvetica, Arial, sans-serif\" \
         font-size=\"12\">"
    );
    let m = &report.machine;
    let date = m.date.get(..10).unwrap_or(&m.date);
    let _ = writeln!(
        s,
        "<title>strata bench: {} on {}, {date}</title>",
        esc(&m.device_name()),
        esc(&m.hostname)
    );
    let _ = writeln!(s, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>");
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"26\" text-anchor=\"middle\" font-size=\"16\" font-weight=\"bold\">\
         strata bench: {}, {date}</text>",
        LEFT + PLOT_W / 2.0,
        esc(&m.device_name())
    );
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"45\" text-anchor=\"middle\" fill=\"#555\">host {}; median of the \
         timed runs; raw paths solid, the store's paths dashed</text>",
        LEFT + PLOT_W / 2.0,
        esc(&m.hostname)
    );

    // Grid and ticks: decades of GB/s (with 2 and 5 between, unlabelled), powers of two of size.
    let _ = writeln!(s, "<g stroke=\"#ddd\" stroke-width=\"1\">");
    let mut ys = String::new();
    let mut d = y0 as i32;
    while d as f64 <= y1 {
        let y = py(d as f64);
        let _ = writeln!(
            s,
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{}\" y2=\"{y:.1}\"/>",
            LEFT + PLOT_W
        );
        let label = fmt_decade(d);
        let _ = writeln!(
            ys,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{label}</text>",
            LEFT - 8.0,
            y + 4.0
        );
        for minor in [2.0f64, 5.0] {
            let ly = d as f64 + minor.log10();
            if ly < y1 {
                let y = py(ly);
                let _ = writeln!(
                    s,
                    "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{}\" y2=\"{y:.1}\" stroke=\"#f0f0f0\"/>",
                    LEFT + PLOT_W
                );
            }
        }
        d += 1;
    }
    let mut xs = String::new();
    for e in x_ticks(x0, x1) {
        let x = px(e as f64);
        let _ =
            writeln!(s, "<line x1=\"{x:.1}\" y1=\"{TOP}\" x2=\"{x:.1}\" y2=\"{}\"/>", TOP + PLOT_H);
        let _ = writeln!(
            xs,
            "<text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            TOP + PLOT_H + 18.0,
            short_size(1u64 << e)
        );
    }
    let _ = writeln!(s, "</g>");
    s.push_str(&ys);
    s.push_str(&xs);
    let _ = writeln!(
        s,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{PLOT_W}\" height=\"{PLOT_H}\" fill=\"none\" \
         stroke=\"#333\"/>"
    );
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"13\">transfer size \
         (log scale)</text>",
        LEFT + PLOT_W / 2.0,
        TOP + PLOT_H + 42.0
    );
    let _ = writeln!(
        s,
        "<text x=\"22\" y=\"{0}\" text-anchor=\"middle\" font-size=\"13\" \
         transform=\"rotate(-90 22 {0})\">bandwidth, GB/s (log scale)</text>",
        TOP + PLOT_H / 2.0
    );

    // One line per path, clipped to the plot area.
    let _ = writeln!(
        s,
        "<clipPath id=\"plot\"><rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{PLOT_W}\" \
         height=\"{PLOT_H}\"/></clipPath>"
    );
    let _ = writeln!(s, "<g clip-path=\"url(#plot)\" fill=\"none\" stroke-width=\"1.8\">");
    for (p, st) in paths.iter().zip(&styles) {
        let mut pts: Vec<(f64, f64)> = report
            .results
            .iter()
            .filter(|m| m.path == *p && m.gbps.is_finite() && m.gbps > 0.0)
            .map(|m| (px((m.size.max(1) as f64).log2()), py(m.gbps.log10())))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let dash = st.dash.map_or(String::new(), |d| format!(" stroke-dasharray=\"{d}\""));
        let _ = writeln!(s, "<g stroke=\"{}\"{dash}><title>{}</title>", st.color, esc(p));
        if pts.len() > 1 {
            let coords: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let _ = writeln!(s, "<polyline points=\"{}\"/>", coords.join(" "));
        }
        for &(x, y) in &pts {
            s.push_str(&marker(x, y, st));
        }
        let _ = writeln!(s, "</g>");
    }
    let _ = writeln!(s, "</g>");

    // The legend: a sample of each line and the path's name.
    let _ = writeln!(s, "<g class=\"legend\">");
    let _ =
        writeln!(s, "<text x=\"{LEGEND_X}\" y=\"{}\" font-weight=\"bold\">path</text>", TOP + 4.0);
    for (i, (p, st)) in paths.iter().zip(&styles).enumerate() {
        let y = TOP + 22.0 + i as f64 * LEGEND_ROW;
        let dash = st.dash.map_or(String::new(), |d| format!(" stroke-dasharray=\"{d}\""));
        let _ = writeln!(
            s,
            "<g stroke=\"{0}\" fill=\"none\" stroke-width=\"1.8\"{dash}><line x1=\"{LEGEND_X}\" \
             y1=\"{y:.1}\" x2=\"{1}\" y2=\"{y:.1}\"/>{2}</g>",
            st.color,
            LEGEND_X + 30.0,
            marker(LEGEND_X + 15.0, y, st).trim_end()
        );
        let _ =
            writeln!(s, "<text x=\"{}\" y=\"{:.1}\">{}</text>", LEGEND_X + 38.0, y + 4.0, esc(p));
    }
    let _ = writeln!(s, "</g>");
    if paths.is_empty() {
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#a00\">nothing was \
             measured</text>",
            LEFT + PLOT_W / 2.0,
            TOP + PLOT_H / 2.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// A marker at (x, y): a filled circle, or a filled square for store paths.
fn marker(x: f64, y: f64, st: &Style) -> String {
    if st.square {
        format!(
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"6\" height=\"6\" fill=\"{}\" \
             stroke-dasharray=\"none\"/>\n",
            x - 3.0,
            y - 3.0,
            st.color
        )
    } else {
        format!(
            "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{}\" stroke-dasharray=\"none\"/>\n",
            st.color
        )
    }
}

/// `10^d` written plainly: `0.01`, `1`, `1000`.
fn fmt_decade(d: i32) -> String {
    if d >= 0 {
        format!("{}", 10f64.powi(d))
    } else {
        format!("{:.*}", (-d) as usize, 10f64.powi(d))
    }
}

/// Exponents of two to put ticks at between 2^x0 and 2^x1: every `step`-th power, `step` the
/// smallest that gives at most 11 ticks, aligned on the smallest size.
fn x_ticks(x0: f64, x1: f64) -> Vec<u32> {
    let first = x0.ceil().max(0.0) as u32;
    let last = x1.floor().clamp(0.0, 63.0) as u32;
    if last < first {
        return Vec::new();
    }
    let span = last - first;
    let step = (span / 10 + 1).max(1);
    (first..=last).step_by(step as usize).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apps::bench::report::{MachineInfo, Measurement, Timer};
    use crate::probe::Timing;

    fn report(paths: &[&str], sizes: &[u64]) -> Report {
        let mut r = Report::new(sizes.to_vec(), paths.iter().map(|p| p.to_string()));
        r.machine = MachineInfo {
            hostname: "h<1>".into(),
            date: "2026-11-23T10:00:00Z".into(),
            cpu: "cpu".into(),
            ..Default::default()
        };
        for (i, p) in paths.iter().enumerate() {
            for &b in sizes {
                let t = Timing { seconds: vec![b as f64 / 1e9 / (i + 1) as f64], bytes: b };
                r.results.push(Measurement::new(p, b, &t, Timer::WallClock));
            }
        }
        r
    }

    #[test]
    fn plot_has_axes_a_line_and_a_legend_entry_per_path() {
        let paths = ["h2d_pinned", "disk_read", "store_pinned_to_device"];
        let sizes = [4096, 1 << 20, 1 << 30];
        let svg = svg_plot(&report(&paths, &sizes));
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("transfer size (log scale)"));
        assert!(svg.contains("bandwidth, GB/s (log scale)"));
        assert!(svg.contains("2026-11-23"));
        assert!(svg.contains("h&lt;1&gt;"), "the host name is escaped");
        for p in paths {
            assert!(svg.contains(&format!(">{p}</text>")), "legend entry for {p}");
        }
        assert_eq!(svg.matches("<polyline").count(), 3);
        for tick in ["4 KiB", "1 MiB", "1 GiB"] {
            assert!(svg.contains(&format!(">{tick}</text>")), "tick {tick}");
        }
        assert!(svg.contains("stroke-dasharray=\"7 4\""), "store paths are dashed");
        // Every tag opened is closed (a cheap well-formedness check).
        assert_eq!(svg.matches("<g").count(), svg.matches("</g>").count());
    }

    #[test]
    fn degenerate_reports_still_plot() {
        let one = svg_plot(&report(&["host_memcpy"], &[4096]));
        assert!(one.contains("<circle") && !one.contains("<polyline"));
        let none = svg_plot(&report(&[], &[]));
        assert!(none.contains("nothing was measured"));
        let mut zero = report(&["x"], &[4096]);
        zero.results[0].gbps = 0.0;
        assert!(!svg_plot(&zero).contains("NaN"));
    }

    #[test]
    fn ticks_and_styles() {
        // 4 KiB .. 1 GiB: every other power of two, 10 ticks.
        assert_eq!(x_ticks(12.0, 30.0), vec![12, 14, 16, 18, 20, 22, 24, 26, 28, 30]);
        assert_eq!(x_ticks(12.0, 20.0), (12..=20).collect::<Vec<_>>());
        assert!(x_ticks(12.2, 12.8).is_empty());
        assert_eq!(fmt_decade(-2), "0.01");
        assert_eq!(fmt_decade(3), "1000");
        let names: Vec<String> = (0..12).map(|i| format!("p{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let st = styles(&refs);
        assert!(st[0].dash.is_none() && st[10].dash.is_some());
        assert_eq!(st[0].color, st[10].color);
    }
}
