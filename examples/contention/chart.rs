//! The chart: two panels of grouped bars, hand-written SVG.

use super::*;

const COLORS: [&str; 4] = ["#4e79a7", "#e15759", "#59a14f", "#f28e2b"];
const WIDTH: f64 = 1200.0;
const HEIGHT: f64 = 500.0;

/// A round axis maximum and tick step for values up to `max`.
fn axis(max: f64) -> (f64, f64) {
    let max = if max > 0.0 { max } else { 1.0 };
    let raw = max / 5.0;
    let magnitude = 10_f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    ((max / step).ceil() * step, step)
}

fn label(v: f64) -> String {
    if v.fract().abs() < 1e-9 || v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn panel(
    svg: &mut String,
    x0: f64,
    title: &str,
    y_label: &str,
    cells: &[Cell],
    value: impl Fn(&Cell) -> f64,
) {
    let (left, right, top, bottom) = (x0 + 70.0, x0 + 450.0, 90.0, 400.0);
    let (axis_max, step) = axis(cells.iter().map(&value).fold(0.0, f64::max));
    let y = |v: f64| bottom - (v / axis_max) * (bottom - top);
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="70" text-anchor="middle" font-size="17" font-weight="bold">{title}</text>"#,
        (left + right) / 2.0
    );
    // Grid and y ticks.
    let mut tick = 0.0;
    while tick <= axis_max + step / 2.0 {
        let ty = y(tick);
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" y1="{ty:.1}" x2="{right}" y2="{ty:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end" font-size="13">{}</text>"##,
            left - 8.0,
            ty + 4.5,
            label(tick)
        );
        tick += step;
    }
    let _ = writeln!(
        svg,
        r#"<text transform="translate({:.1},{:.1}) rotate(-90)" text-anchor="middle" font-size="14">{y_label}</text>"#,
        x0 + 20.0,
        (top + bottom) / 2.0
    );
    // Bars, grouped by scenario.
    let group_width = (right - left) / SCENARIOS.len() as f64;
    let bar = 36.0;
    let gap = 10.0;
    for (g, scenario) in SCENARIOS.iter().enumerate() {
        let center = left + group_width * (g as f64 + 0.5);
        let n = STRATEGIES.len() as f64;
        let first = center - (n * bar + (n - 1.0) * gap) / 2.0;
        for (s, strategy) in STRATEGIES.iter().enumerate() {
            let Some(cell) = cells
                .iter()
                .find(|c| c.scenario == *scenario && c.strategy == *strategy)
            else {
                continue;
            };
            let v = value(cell);
            let bx = first + s as f64 * (bar + gap);
            let by = y(v);
            let _ = writeln!(
                svg,
                r#"<rect x="{bx:.1}" y="{by:.1}" width="{bar}" height="{:.1}" fill="{}"/><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="13">{}</text>"#,
                (bottom - by).max(0.0),
                COLORS[s],
                bx + bar / 2.0,
                by - 6.0,
                label(v)
            );
        }
        let caption = match scenario {
            Scenario::Low => "low: 50 disjoint pairs",
            Scenario::Hot => "hot: 50 from one account",
        };
        let _ = writeln!(
            svg,
            r#"<text x="{center:.1}" y="{:.1}" text-anchor="middle" font-size="14">{caption}</text>"#,
            bottom + 24.0
        );
    }
    let _ = writeln!(
        svg,
        r##"<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#333"/><line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#333"/>"##
    );
}

pub(crate) fn chart(cells: &[Cell], repeats: usize) -> String {
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/><text x="{:.1}" y="32" text-anchor="middle" font-size="20" font-weight="bold">{WRITERS} concurrent transfers on PostgreSQL (median of {repeats} runs)</text>"#,
        WIDTH / 2.0
    );
    panel(
        &mut svg,
        0.0,
        "Wall time",
        "milliseconds (lower is better)",
        cells,
        |c| c.wall_ms,
    );
    panel(
        &mut svg,
        WIDTH / 2.0,
        "Wasted attempts",
        "attempts beyond one per writer",
        cells,
        Cell::wasted,
    );
    // Legend.
    let legend_y = HEIGHT - 40.0;
    let captions = [
        "optimistic (versioned + retry)",
        "pessimistic (FOR UPDATE)",
        "adaptive (on_conflict = lock)",
        "adaptive, first burst (no hot-row memory)",
    ];
    // About 7.5 px per character at 14 px, plus the swatch and a gap.
    let item_width = |caption: &str| 22.0 + 7.5 * caption.len() as f64 + 36.0;
    let total: f64 = captions.iter().map(|c| item_width(c)).sum::<f64>() - 36.0;
    let mut lx = (WIDTH - total) / 2.0;
    for (color, caption) in COLORS.iter().zip(captions) {
        let _ = writeln!(
            svg,
            r#"<rect x="{lx:.1}" y="{:.1}" width="16" height="16" fill="{color}"/><text x="{:.1}" y="{:.1}" font-size="14">{caption}</text>"#,
            legend_y - 13.0,
            lx + 22.0,
            legend_y
        );
        lx += item_width(caption);
    }
    svg.push_str("</svg>\n");
    svg
}
