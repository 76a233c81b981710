//! The bandwidth plot as SVG, drawn with plotters: GB/s (log scale) against transfer size (log
//! scale, a tick at each size swept), one line per path, a legend beside the plot.

use plotters::coord::combinators::IntoLogRange;
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use super::report::{short_size, Report};
use strata::{Error, Result};

/// Matplotlib's "tab10" palette: distinct on white, and for most colour-blind readers.
const PALETTE: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

const WIDTH: u32 = 1060;
const PLOT_WIDTH: u32 = 760;
const MIN_HEIGHT: u32 = 600;
const LEGEND_ROW: u32 = 17;

/// How a path's line looks: colour, dashes (`None`: solid), square markers or round.
struct Style {
    color: RGBColor,
    dash: Option<(u32, u32)>,
    square: bool,
}

/// Raw paths get solid lines and round markers, store paths dashed lines and square markers;
/// the colours cycle within each group, with shorter dashes once a group has used them all.
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
                (true, 0) => Some((7, 4)),
                (false, _) => Some((2, 3)),
                (true, _) => Some((4, 2)),
            };
            Style { color: PALETTE[k % PALETTE.len()], dash, square: is_store }
        })
        .collect()
}

fn plot_error(e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("drawing the plot: {e}"))
}

/// The SVG plot of a report: bandwidth against size, one line per measured path.
pub fn svg_plot(report: &Report) -> Result<String> {
    let paths = report.measured_paths();
    let styles = styles(&paths);
    let height = MIN_HEIGHT.max(100 + paths.len() as u32 * LEGEND_ROW);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let (plot, legend) = root.split_horizontally(PLOT_WIDTH);
        draw_chart(&plot, report, &paths, &styles).map_err(plot_error)?;
        draw_legend(&legend, &paths, &styles).map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// The tick label of `x = log2(bytes)`: the size at whole powers of two, nothing between.
fn size_label(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-6 && (0.0..63.0).contains(x) {
        short_size(1u64 << x.round() as u32)
    } else {
        String::new()
    }
}

/// The tick label of a bandwidth: `0.1`, `1`, `10`, `2.5`.
fn gbps_label(y: &f64) -> String {
    let s = format!("{y:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

type DrawResult = std::result::Result<(), DrawingAreaErrorKind<std::io::Error>>;

fn draw_chart(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    report: &Report,
    paths: &[&str],
    styles: &[Style],
) -> DrawResult {
    // x: log2 of the size (ticks at whole powers of two); y: GB/s on a log scale. Both padded
    // so that no marker sits on an axis.
    let xs: Vec<f64> = report.sizes.iter().map(|&b| (b.max(1) as f64).log2()).collect();
    let (mut x0, mut x1) =
        xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    if !x0.is_finite() {
        (x0, x1) = (12.0, 30.0);
    }
    if x1 - x0 < 1.0 {
        (x0, x1) = (x0 - 1.0, x1 + 1.0);
    }
    let pad = (x1 - x0) * 0.04;
    let gbps: Vec<f64> =
        report.results.iter().map(|m| m.gbps).filter(|g| g.is_finite() && *g > 0.0).collect();
    let lo = gbps.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = gbps.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = if lo.is_finite() { (lo / 1.6, hi * 1.6) } else { (0.01, 100.0) };

    let m = &report.machine;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("strata bench: {} ({}), {}", m.hostname, m.device_name(), m.date),
            ("sans-serif", 16),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((x0 - pad)..(x1 + pad), (lo..hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("transfer size (log scale)")
        .y_desc("GB/s (10^9 bytes/s, log scale)")
        .x_labels(((x1 - x0).ceil() as usize + 1).min(24))
        .x_label_formatter(&size_label)
        .y_label_formatter(&gbps_label)
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.1))
        .draw()?;

    for (path, style) in paths.iter().zip(styles) {
        let points: Vec<(f64, f64)> = report
            .results
            .iter()
            .filter(|r| r.path == *path && r.gbps.is_finite() && r.gbps > 0.0)
            .map(|r| ((r.size.max(1) as f64).log2(), r.gbps))
            .collect();
        let line = style.color.stroke_width(2);
        match style.dash {
            None => chart.draw_series(LineSeries::new(points.iter().copied(), line))?,
            Some((dash, gap)) => {
                chart.draw_series(DashedLineSeries::new(points.iter().copied(), dash, gap, line))?
            }
        };
        let fill = style.color.filled();
        if style.square {
            chart.draw_series(
                points
                    .iter()
                    .map(|&p| EmptyElement::at(p) + Rectangle::new([(-3, -3), (3, 3)], fill)),
            )?;
        } else {
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, fill)))?;
        }
    }
    Ok(())
}

fn draw_legend(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    paths: &[&str],
    styles: &[Style],
) -> DrawResult {
    let text = ("sans-serif", 12).into_font().color(&BLACK);
    area.draw(&Text::new("path", (10, 52), ("sans-serif", 13).into_font().style(FontStyle::Bold)))?;
    for (i, (path, style)) in paths.iter().zip(styles).enumerate() {
        let y = 76 + i as i32 * LEGEND_ROW as i32;
        let line = style.color.stroke_width(2);
        let seg = [(10, y), (40, y)];
        match style.dash {
            None => area.draw(&PathElement::new(seg, line))?,
            Some((dash, gap)) => area.draw(&DashedPathElement::new(seg, dash, gap, line))?,
        }
        let fill = style.color.filled();
        if style.square {
            area.draw(&Rectangle::new([(22, y - 3), (28, y + 3)], fill))?;
        } else {
            area.draw(&Circle::new((25, y), 3, fill))?;
        }
        area.draw(&Text::new(path.to_string(), (48, y - 6), text.clone()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::bench::{Measurement, Timer};
    use strata::probe::Timing;

    #[test]
    fn plot_has_a_line_and_a_legend_entry_per_path() {
        let mut r = Report::new(
            vec![4096, 1 << 20, 1 << 30],
            ["h2d_pinned", "store_pinned_to_device"].map(String::from),
        );
        for (path, gbps) in
            [("h2d_pinned", [1.0, 20.0, 55.0]), ("store_pinned_to_device", [0.5, 18.0, 53.0])]
        {
            for (&size, g) in r.sizes.clone().iter().zip(gbps) {
                let t = Timing { seconds: vec![size as f64 / (g * 1e9)], bytes: size };
                r.results.push(Measurement::new(path, size, &t, Timer::CudaEvents));
            }
        }
        let svg = svg_plot(&r).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..200]);
        assert!(svg.trim_end().ends_with("</svg>"));
        // plotters writes each text on a line of its own.
        for label in ["h2d_pinned", "store_pinned_to_device", "4 KiB", "1 MiB", "1 GiB", "10"] {
            assert!(svg.contains(&format!("\n{label}\n</text>")), "{label} in the plot");
        }
        assert!(svg.contains("GB/s (10^9 bytes/s, log scale)"));
        // Solid polyline for the raw path, dashes for the store path; markers at each point.
        assert!(svg.matches("<polyline").count() >= 2, "lines drawn");
        assert!(svg.matches("<circle").count() >= 3 && svg.contains("<rect"), "markers drawn");
        // An empty report still gives a plot (axes, no lines).
        assert!(svg_plot(&Report::default()).unwrap().contains("</svg>"));
    }

    #[test]
    fn tick_labels_are_round() {
        assert_eq!(size_label(&12.0), "4 KiB");
        assert_eq!(size_label(&12.5), "");
        assert_eq!(gbps_label(&0.1), "0.1");
        assert_eq!(gbps_label(&10.0), "10");
        assert_eq!(gbps_label(&2.5), "2.5");
    }

    #[test]
    fn styles_tell_raw_from_store_paths() {
        let s = styles(&["h2d_pinned", "store_disk_to_device", "d2h_pinned"]);
        assert!(s[0].dash.is_none() && !s[0].square);
        assert!(s[1].dash.is_some() && s[1].square);
        assert_eq!(s[0].color, PALETTE[0]);
        assert_eq!(s[2].color, PALETTE[1]);
        assert_eq!(s[1].color, PALETTE[0]);
    }
}
