//! The pages as HTML: `format!` and [`esc`], one inline stylesheet, no
//! script. Every value from the database or the request goes through
//! [`esc`].

use std::fmt::Write;
use std::time::Duration;

use idem_runtime::operate::{
    ConsumerStats, DeadEvent, DeadJobRow, InboxDead, JobStatsView, KeyRecord, OutboxStatsView,
    RecordStats,
};

/// Text made safe for HTML content and quoted attribute values.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Text made safe for a URL's query component (then escaped for HTML).
pub(crate) fn query_value(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}\
header{background:#263238;color:#fff;padding:.6em 1.2em}header a{color:#cfd8dc;margin-right:1.2em;text-decoration:none}\
header b{margin-right:2em}main{padding:1em 1.2em}h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.4em}\
table{border-collapse:collapse;background:#fff;margin:.4em 0}td,th{border:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:top}\
th{background:#eceff1}td.n{text-align:right;font-variant-numeric:tabular-nums}.cards{display:flex;gap:1em;flex-wrap:wrap}\
.card{background:#fff;border:1px solid #ddd;padding:.6em 1em;min-width:14em}.bad{color:#b71c1c;font-weight:bold}\
.note{color:#666}.msg{background:#fff3e0;border:1px solid #ffb74d;padding:.5em 1em}button{margin:.1em}\
pre{background:#fff;border:1px solid #ddd;padding:.5em;max-width:60em;overflow:auto}";

/// A whole page: the header's links, `title`, `body`.
pub(crate) fn layout(base: &str, title: &str, read_only: bool, body: &str) -> String {
    let b = esc(base);
    // Nested at `/admin`, the overview is `/admin` (axum's `/admin/` is another path).
    let home = if base.is_empty() {
        "/".to_owned()
    } else {
        b.clone()
    };
    let mode = if read_only {
        "read-only"
    } else {
        "actions enabled"
    };
    format!(
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">\
<title>{t} · idem admin</title><style>{STYLE}</style></head><body>\
<header><b>idem admin</b><a href=\"{home}\">Overview</a><a href=\"{b}/jobs\">Dead jobs</a>\
<a href=\"{b}/events\">Dead events</a><a href=\"{b}/inbox\">Inbox</a><a href=\"{b}/key\">Key lookup</a>\
<span class=\"note\">{mode}</span></header><main><h1>{t}</h1>{body}</main></body></html>",
        t = esc(title),
    )
}

fn age(d: Option<Duration>) -> String {
    match d {
        None => "none".to_owned(),
        Some(d) => {
            let s = d.as_secs();
            if s < 120 {
                format!("{s} s")
            } else if s < 7200 {
                format!("{} min", s / 60)
            } else if s < 172_800 {
                format!("{} h", s / 3600)
            } else {
                format!("{} d", s / 86_400)
            }
        }
    }
}

fn num(id: &str, n: i64) -> String {
    let class = if n > 0 && (id.contains("dead") || id.contains("unknown")) {
        "n bad"
    } else {
        "n"
    };
    format!("<td class=\"{class}\" id=\"{id}\">{n}</td>")
}

/// The overview: counts and oldest ages.
pub(crate) fn overview(
    records: &RecordStats,
    outbox: &OutboxStatsView,
    jobs: &JobStatsView,
    inbox: &[ConsumerStats],
    inbox_more: bool,
) -> String {
    let mut s = String::from("<div class=\"cards\">");
    let _ = write!(
        s,
        "<div class=\"card\"><h2>Outbox</h2><table>\
<tr><th>pending</th>{}</tr><tr><th>dead</th>{}</tr><tr><th>oldest pending</th><td id=\"outbox-oldest\">{}</td></tr></table></div>",
        num("outbox-pending", outbox.pending),
        num("outbox-dead", outbox.dead),
        age(outbox.oldest_pending)
    );
    let _ = write!(
        s,
        "<div class=\"card\"><h2>Jobs</h2><table>\
<tr><th>due</th>{}</tr><tr><th>running</th>{}</tr><tr><th>dead</th>{}</tr><tr><th>oldest overdue</th><td id=\"jobs-oldest\">{}</td></tr></table></div>",
        num("jobs-due", jobs.due),
        num("jobs-running", jobs.running),
        num("jobs-dead", jobs.dead),
        age(jobs.oldest_due)
    );
    let _ = write!(
        s,
        "<div class=\"card\"><h2>Idempotency records</h2><table>\
<tr><th>in progress</th>{}</tr><tr><th>lease expired</th>{}</tr><tr><th>completed</th>{}</tr>\
<tr><th>past retention</th>{}</tr><tr><th>outcome unknown</th>{}</tr></table></div>",
        num("records-in-progress", records.in_progress),
        num("records-lease-expired", records.lease_expired),
        num("records-completed", records.completed),
        num("records-expired", records.expired),
        num("records-unknown", records.unknown)
    );
    s.push_str("<div class=\"card\"><h2>Inbox</h2>");
    if inbox.is_empty() {
        s.push_str("<p class=\"note\">No consumer has records.</p>");
    } else {
        s.push_str("<table><tr><th>consumer</th><th>done</th><th>dead</th></tr>");
        for c in inbox {
            let _ = write!(
                s,
                "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n{}\">{}</td></tr>",
                esc(&c.consumer),
                c.done,
                if c.dead > 0 { " bad" } else { "" },
                c.dead
            );
        }
        s.push_str("</table>");
        if inbox_more {
            s.push_str("<p class=\"note\">More consumers than one page: see Inbox.</p>");
        }
    }
    s.push_str("</div></div>");
    s.push_str(&gauges(outbox, jobs));
    s
}

/// The `metrics` gauges idem sets, with the values the relay and the
/// worker set them to from these same counts ([`OutboxStatsView::gauges`],
/// [`JobStatsView::gauges`]): a fixed list, one row each.
fn gauges(outbox: &OutboxStatsView, jobs: &JobStatsView) -> String {
    let mut s = String::from(
        "<h2>Gauges</h2><p class=\"note\">The <code>metrics</code> gauges idem exports (feature \
<code>metrics</code>: the relay sets the outbox's at each cleanup, the worker the jobs' every \
<code>gauge_interval</code>), computed now from the counts above: a dashboard shows these values \
after its next refresh.</p><table id=\"gauges\"><tr><th>gauge</th><th>value</th></tr>",
    );
    for (name, value) in outbox.gauges().into_iter().chain(jobs.gauges()) {
        let _ = write!(
            s,
            "<tr><td><code>{name}</code></td><td class=\"n\" id=\"gauge-{name}\">{}</td></tr>",
            gauge_value(value)
        );
    }
    s.push_str("</table>");
    s
}

/// A gauge's value as a dashboard shows it: whole numbers bare, seconds
/// to the millisecond.
fn gauge_value(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v}")
    } else {
        format!("{v:.3}")
    }
}

/// The paging links under a list.
pub(crate) fn pager(url: &str, offset: i64, limit: i64, shown: usize) -> String {
    let mut s = String::from("<p>");
    // In an attribute a bare `&` starts a character reference.
    let sep = if url.contains('?') { "&amp;" } else { "?" };
    if offset > 0 {
        let prev = (offset - limit).max(0);
        let _ = write!(
            s,
            "<a href=\"{}{sep}offset={prev}\">« previous</a> ",
            esc(url)
        );
    }
    if shown == 0 {
        s.push_str("<span class=\"note\">no rows</span>");
    } else {
        let _ = write!(
            s,
            "<span class=\"note\">rows {}–{}</span>",
            offset + 1,
            offset + shown as i64
        );
    }
    if shown as i64 >= limit {
        let _ = write!(
            s,
            " <a href=\"{}{sep}offset={}\">next »</a>",
            esc(url),
            offset + limit
        );
    }
    s.push_str("</p>");
    s
}

/// The hidden field every action form carries.
fn token(csrf: &str) -> String {
    format!(
        "<input type=\"hidden\" name=\"csrf\" value=\"{}\">",
        esc(csrf)
    )
}

fn filter_form(base: &str, path: &str, name: &str, label: &str, value: &str) -> String {
    format!(
        "<form method=\"get\" action=\"{}{path}\">{label} <input name=\"{name}\" value=\"{}\"> <button>Filter</button></form>",
        esc(base),
        esc(value)
    )
}

/// The "all matching, at most N" form of a list.
fn bulk_form(base: &str, path: &str, csrf: &str, filter: (&str, &str), limit: i64) -> String {
    format!(
        "<form method=\"post\" action=\"{b}{path}\" id=\"bulk\">{t}<input type=\"hidden\" name=\"{fname}\" value=\"{fval}\">\
All matching, at most <input name=\"limit\" type=\"number\" min=\"1\" max=\"{limit}\" value=\"{limit}\"> \
<button name=\"op\" value=\"requeue_all\">Requeue all</button> <button name=\"op\" value=\"discard_all\">Discard all</button></form>",
        b = esc(base),
        t = token(csrf),
        fname = filter.0,
        fval = esc(filter.1),
    )
}

/// Dead jobs, one page; with action forms when `csrf` is given.
pub(crate) fn dead_jobs(
    base: &str,
    kind: &str,
    rows: &[DeadJobRow],
    csrf: Option<&str>,
    show_payloads: bool,
    limit: i64,
) -> String {
    let mut s = filter_form(base, "/jobs", "kind", "Kind", kind);
    if rows.is_empty() {
        s.push_str("<p id=\"empty\">No dead jobs.</p>");
        return s;
    }
    if let Some(csrf) = csrf {
        let _ = write!(
            s,
            "<form method=\"post\" action=\"{}/jobs/action\" id=\"rows\">{}<input type=\"hidden\" name=\"kind\" value=\"{}\">",
            esc(base),
            token(csrf),
            esc(kind)
        );
    }
    s.push_str("<table><tr><th></th><th>id</th><th>kind</th><th>key</th><th>attempts</th><th>dead for</th><th>last error</th><th>payload</th><th></th></tr>");
    for j in rows {
        let payload = if show_payloads {
            format!("<pre>{}</pre>", esc(&j.payload.to_string()))
        } else {
            format!(
                "<span class=\"note\">hidden ({} bytes)</span>",
                j.payload_bytes()
            )
        };
        // Its stored text, shown as a JSON string: said, so that it is not
        // read as a payload that is one.
        let payload = match j.payload_unreadable {
            true => format!("<span class=\"note\">unreadable as JSON</span> {payload}"),
            false => payload,
        };
        let (check, buttons) = if csrf.is_some() {
            (
                format!("<input type=\"checkbox\" name=\"id\" value=\"{}\">", j.id),
                format!(
                    "<button name=\"op\" value=\"requeue:{id}\" id=\"requeue-{id}\">Requeue</button>\
<button name=\"op\" value=\"discard:{id}\" id=\"discard-{id}\">Discard</button>",
                    id = j.id
                ),
            )
        } else {
            (String::new(), String::new())
        };
        let _ = write!(
            s,
            "<tr class=\"job\" id=\"job-{id}\"><td>{check}</td><td class=\"n\">{id}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td><td>{payload}</td><td>{buttons}</td></tr>",
            esc(&j.kind),
            esc(&j.key),
            j.attempts,
            age(Some(j.dead_for)),
            esc(&j.last_error),
            id = j.id,
        );
    }
    s.push_str("</table>");
    if let Some(csrf) = csrf {
        s.push_str("<button name=\"op\" value=\"requeue_selected\">Requeue selected</button> <button name=\"op\" value=\"discard_selected\">Discard selected</button></form>");
        s.push_str(&bulk_form(
            base,
            "/jobs/action",
            csrf,
            ("kind", kind),
            limit,
        ));
    }
    s
}

/// Dead events, one page; with action forms when `csrf` is given.
pub(crate) fn dead_events(
    base: &str,
    key: &str,
    rows: &[DeadEvent],
    csrf: Option<&str>,
    limit: i64,
) -> String {
    let mut s = filter_form(base, "/events", "key", "Key", key);
    if rows.is_empty() {
        s.push_str("<p id=\"empty\">No dead events.</p>");
        return s;
    }
    if let Some(csrf) = csrf {
        let _ = write!(
            s,
            "<form method=\"post\" action=\"{}/events/action\" id=\"rows\">{}<input type=\"hidden\" name=\"key\" value=\"{}\">",
            esc(base),
            token(csrf),
            esc(key)
        );
    }
    s.push_str("<table><tr><th></th><th>id</th><th>key</th><th>seq</th><th>subject</th><th>kind</th><th>attempts</th><th>age</th><th>last error</th><th></th></tr>");
    for e in rows {
        let id = esc(&e.id);
        let (check, buttons) = if csrf.is_some() {
            (
                format!("<input type=\"checkbox\" name=\"id\" value=\"{id}\">"),
                format!(
                    "<button name=\"op\" value=\"requeue:{id}\">Requeue</button><button name=\"op\" value=\"discard:{id}\">Discard</button>"
                ),
            )
        } else {
            (String::new(), String::new())
        };
        let _ = write!(
            s,
            "<tr class=\"event\"><td>{check}</td><td>{id}</td><td>{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td><td>{buttons}</td></tr>",
            esc(&e.key),
            e.seq,
            esc(&e.subject),
            esc(&e.kind),
            e.attempts,
            age(Some(e.age)),
            esc(e.last_error.as_deref().unwrap_or("")),
        );
    }
    s.push_str("</table>");
    if let Some(csrf) = csrf {
        s.push_str("<button name=\"op\" value=\"requeue_selected\">Requeue selected</button> <button name=\"op\" value=\"discard_selected\">Discard selected</button></form>");
        s.push_str(&bulk_form(
            base,
            "/events/action",
            csrf,
            ("key", key),
            limit,
        ));
    }
    s
}

/// The inbox's consumers, and one consumer's dead letters when chosen.
pub(crate) fn inbox(
    base: &str,
    consumers: &[ConsumerStats],
    chosen: Option<(&str, &[InboxDead])>,
) -> String {
    let mut s = String::from("<table><tr><th>consumer</th><th>done</th><th>dead</th></tr>");
    for c in consumers {
        let _ = write!(
            s,
            "<tr><td><a href=\"{}/inbox?consumer={}\">{}</a></td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            esc(base),
            esc(&query_value(&c.consumer)),
            esc(&c.consumer),
            c.done,
            c.dead
        );
    }
    s.push_str("</table>");
    if let Some((consumer, letters)) = chosen {
        let _ = write!(
            s,
            "<h2>Dead letters of {}</h2><p class=\"note\">A requeue runs the consumer's effect: it belongs to the consumer's code (Inbox::requeue).</p>",
            esc(consumer)
        );
        s.push_str("<table><tr><th>message id</th><th>deliveries</th><th>last error</th><th>body</th><th>parked at (Unix s)</th></tr>");
        for l in letters {
            let _ = write!(
                s,
                "<tr><td>{}</td><td class=\"n\">{}</td><td>{}</td><td>{} bytes</td><td class=\"n\">{}</td></tr>",
                esc(&l.msg_id),
                l.deliveries,
                esc(&l.last_error),
                l.payload_bytes,
                l.parked_at
            );
        }
        s.push_str("</table>");
    }
    s
}

/// The key lookup form, and what it found.
pub(crate) fn key_lookup(
    base: &str,
    scope: &str,
    key: &str,
    found: Option<Option<&KeyRecord>>,
    show_payloads: bool,
) -> String {
    let mut s = format!(
        "<form method=\"get\" action=\"{}/key\">Scope (JSON, as the function's <code>scope = ..</code> gives it; empty: none) \
<input name=\"scope\" value=\"{}\"> Key <input name=\"key\" value=\"{}\"> <button>Look up</button></form>",
        esc(base),
        esc(scope),
        esc(key)
    );
    match found {
        None => {}
        Some(None) => s.push_str("<p id=\"not-found\">No record of this key under this scope.</p>"),
        Some(Some(r)) => {
            let response = match (&r.response, show_payloads) {
                (None, _) => "none".to_owned(),
                (Some(v), true) => format!("<pre>{}</pre>", esc(&v.to_string())),
                (Some(v), false) => format!(
                    "<span class=\"note\">hidden ({} bytes)</span>",
                    v.to_string().len()
                ),
            };
            let rows = [
                ("key", esc(&r.key)),
                (
                    "scope",
                    esc(r.scope_label.as_deref().unwrap_or("(not kept)")),
                ),
                ("scope hash", esc(&r.scope)),
                ("operation", esc(&r.operation)),
                ("state", esc(&r.state)),
                ("outcome", esc(r.outcome.as_deref().unwrap_or("none"))),
                ("mode", esc(&r.mode)),
                ("fingerprint", esc(&r.fingerprint)),
                ("age", age(Some(r.age))),
                (
                    "expires in",
                    if r.expired {
                        "expired".to_owned()
                    } else if r.state != "completed" {
                        // No purge or call acts on its retention (KeyRecord::expired).
                        "kept until settled".to_owned()
                    } else {
                        age(Some(r.expires_in))
                    },
                ),
                (
                    "lease left",
                    r.lease_left.map_or("none".to_owned(), |d| age(Some(d))),
                ),
                ("owner", esc(r.owner.as_deref().unwrap_or("none"))),
                ("response", response),
            ];
            s.push_str("<table id=\"record\">");
            for (name, value) in rows {
                let _ = write!(s, "<tr><th>{name}</th><td>{value}</td></tr>");
            }
            s.push_str("</table>");
        }
    }
    s
}

/// What an action did, with a link back.
pub(crate) fn done(back: &str, lines: &[String]) -> String {
    let mut s = String::from("<div class=\"msg\" id=\"result\"><ul>");
    for l in lines {
        let _ = write!(s, "<li>{}</li>", esc(l));
    }
    if lines.is_empty() {
        s.push_str("<li>Nothing matched.</li>");
    }
    let _ = write!(s, "</ul></div><p><a href=\"{}\">Back</a></p>", esc(back));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(
            esc("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(query_value("a b&c"), "a%20b%26c");
    }

    #[test]
    fn the_pager_says_which_rows_or_none() {
        assert!(pager("/admin/jobs", 0, 50, 3).contains("rows 1–3"));
        assert!(pager("/admin/jobs", 50, 50, 50).contains("rows 51–100"));
        for offset in [0, 1, 50] {
            let empty = pager("/admin/jobs", offset, 50, 0);
            assert!(empty.contains("no rows"), "{empty}");
            assert!(
                !empty.contains("rows 1–1") && !empty.contains("next"),
                "{empty}"
            );
        }
    }

    #[test]
    fn gauge_values_as_a_dashboard_shows_them() {
        assert_eq!(gauge_value(3.0), "3");
        assert_eq!(gauge_value(0.0), "0");
        assert_eq!(gauge_value(12.345_678), "12.346");
    }
}
